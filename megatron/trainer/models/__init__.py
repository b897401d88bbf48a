"""Pipeline-stage models built from megatron-core components."""
