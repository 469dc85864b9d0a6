"""The wire between engine and sidecar: journal lines and failure reports.

* :mod:`kvobs.wire.format`: the format, defined once: record kinds, fields, versions, limits, the
  checks a field read back passes, key refs, file names (built and parsed), the record types;
* :mod:`kvobs.wire.decode`: every reader (the sidecar, its checkpoint, ``kvobs explain``); stdlib only;
* :mod:`kvobs.wire.encode`: the engine's writers (lines from removal runs, reports from a diagnosis);
* :mod:`kvobs.wire.histogram`: ``Histogram``, as readers aggregate and reports carry it.

Importing the package loads none of them; none imports numpy or vLLM at import.
"""
