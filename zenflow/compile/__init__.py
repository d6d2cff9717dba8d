"""The compiler: the ``zenflow`` torch.compile backend (``backend``), the ops its passes insert
into backward graphs (``ops``) and the passes themselves (``passes``, one FX pass per file).

Kept light: torch resolves ``backend="zenflow"`` by its entry point, which imports
``zenflow.compile.backend`` and nothing of the runtime's C++ core.
"""
