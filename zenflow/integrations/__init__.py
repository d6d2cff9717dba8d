"""Glue for libraries that drive the training loop themselves (``zenflow.integrations.transformers``)."""
