"""Tensor traces in llama.cpp's names: what ``Engine.trace`` records (``record``), the
``pyimp-dump`` command that writes them (``dump``) and ``pyimp-compare``, which compares two
dumps tensor by tensor (``compare``)."""
