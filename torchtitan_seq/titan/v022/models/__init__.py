"""torchtitan models with chunk-aware attention, one package per model as torchtitan keeps its own."""
