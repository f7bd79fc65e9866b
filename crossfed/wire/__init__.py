"""The weights-and-deltas wire format, one module per part (import the module you need).

* :mod:`crossfed.wire.digests`: ``algo:hex`` digests and chunked reads (no torch).
* :mod:`crossfed.wire.libc`: glibc tuning for weight transfers (no torch).
* :mod:`crossfed.wire.tensors`: safetensors files streamed tensor by tensor, read by ``pread``.
* :mod:`crossfed.wire.deltas`: delta arithmetic (``site - global`` in fp32, sent as bf16).
* :mod:`crossfed.wire.codecs`: int8 / int4 delta codecs and error feedback.

Each module imports only those above it in this list, so the package has no import cycle;
the HTTP transport that moves these files is :mod:`crossfed.client.http` (site
side), :mod:`crossfed.coordinator.blobs` and :mod:`crossfed.coordinator.http_ranged`.
"""
