"""HunyuanImage-3.0 inference engine, in five layers whose imports run one way:

    serve -> runtime -> model -> parallel -> checkpoint        (hunyuan_kernels/ beside them, importing none)

checkpoint: what the checkpoint says; parallel: who holds what; model: the modules and their weights;
runtime: one request on one rank, phase by phase; serve: worker processes, server and client.
This root package holds constants only."""
from pathlib import Path

# The small model shipped in the repository (see README, "Embedded model"): the default of the studio
# and of the command line when it is there (a checkout or an editable install).
EMBEDDED_MODEL = Path(__file__).resolve().parents[1] / "assets" / "model"
