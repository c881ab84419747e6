"""The bench's GC probe, loaded as ``sitecustomize`` by the processes it starts (see ``sitecustomize.py``)."""
