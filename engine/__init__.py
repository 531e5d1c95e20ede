"""HunyuanImage-3.0 inference engine: checkpoint, model, phases, pipeline."""
