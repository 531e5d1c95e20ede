"""Training of the embedded default model: a small HunyuanImage-3.0-architecture model (Instruct-Distil
style) trained on a procedural dataset of flat-colour shape scenes, with its tokenizer, detector and
evaluator. Everything runs through the engine's own modules and sequence builders."""
