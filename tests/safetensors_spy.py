"""A stand-in for safetensors' safe_open that records what the loader reads.

Install it where `snugfit.model.hf` looks safe_open up:

    spy = SafetensorsSpy(hfmod.safe_open)
    monkeypatch.setattr(hfmod, "safe_open", spy)   # or hfmod.safe_open = spy in a rank process

`spy.names`: every tensor name passed to get_slice, in order (every load_hf read
starts there: shape check, then rows or the whole tensor). `spy.nbytes`: bytes
returned by reads, row slices and whole tensors (get_tensor) alike; `spy.largest`:
the most one read returned. Only the
calls the loader makes are provided, so a new way of reading fails loudly
instead of going uncounted.
"""

from __future__ import annotations


class SafetensorsSpy:
    def __init__(self, real_open):
        self.real_open = real_open
        self.names: list[str] = []
        self.nbytes = self.largest = 0

    def clear(self) -> None:
        self.names.clear()  # in place: callers may hold the list
        self.nbytes = self.largest = 0

    def count(self, t) -> None:
        self.nbytes += t.nbytes
        self.largest = max(self.largest, t.nbytes)

    def __call__(self, *args, **kwargs) -> _File:
        return _File(self, self.real_open(*args, **kwargs))


class _File:
    def __init__(self, spy: SafetensorsSpy, f):
        self.spy, self.f = spy, f

    def __enter__(self):
        self.inner = self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name):
        self.spy.names.append(name)
        return _Slice(self.spy, self.inner.get_slice(name))

    def get_tensor(self, name):
        t = self.inner.get_tensor(name)
        self.spy.count(t)
        return t


class _Slice:
    def __init__(self, spy: SafetensorsSpy, sl):
        self.spy, self.sl = spy, sl

    def get_shape(self):
        return self.sl.get_shape()

    def __getitem__(self, index):
        t = self.sl[index]
        self.spy.count(t)
        return t
