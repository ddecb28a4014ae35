"""Measurements that run the runtime (above it in the layering): this machine's rates and the runtime's own costs
(`hardware`), and a single-process plan's peak and step time (`step`), which the models below are calibrated and
checked against."""
