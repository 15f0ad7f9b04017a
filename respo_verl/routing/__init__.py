"""MoE routing replay and route-drift diagnostics (torch + transformers; never verl or megatron.core)."""
