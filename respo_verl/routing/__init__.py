"""MoE routing replay and route drift: the replay mode a job asks for (:mod:`~respo_verl.routing.mode`), the drift
statistics (:mod:`~respo_verl.routing.diagnostics`, torch only), R2/R3 replay for transformers' Qwen3-MoE
(:mod:`~respo_verl.routing.hf`), the drift monitor and replay-input checks on megatron-core's replay seam
(:mod:`~respo_verl.routing.megatron`, the one module that imports megatron-core), and the route-drift Megatron engine
registered with verl (:mod:`~respo_verl.routing.engine`, which imports verl only when verl imports its own Megatron
engine)."""
