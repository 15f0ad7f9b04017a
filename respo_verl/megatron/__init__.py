"""megatron-core glue: the only package that imports megatron.core (routing-replay diagnostics, CPU helpers)."""
