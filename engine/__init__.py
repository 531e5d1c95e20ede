"""HunyuanImage-3.0 inference engine: checkpoint, model, phases, pipeline."""
from pathlib import Path

# The small model shipped in the repository (see README, "Embedded model"): the default of the studio
# and of the command line when it is there (a checkout or an editable install).
EMBEDDED_MODEL = Path(__file__).resolve().parents[1] / "assets" / "model"
