"""Backends of pyimp's own kernels under the conformance interface (:mod:`pyimp.testing`)."""
