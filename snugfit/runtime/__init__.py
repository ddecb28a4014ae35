"""Runtime: executes a Plan on torch.distributed. One technique per file; `apply.build_engine` is the entry."""
