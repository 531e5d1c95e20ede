"""The command line from a clean folder: a tiny checkpoint (`python -m tools.tiny`), then text and generate
(T2I and TI2I)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from engine import EMBEDDED_MODEL

ROOT = Path(__file__).resolve().parents[1]


def run(*args, check=True, module="engine"):
    p = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if check:
        assert p.returncode == 0, p.stderr[-2000:]
    return p


def test_make_tiny_then_text_and_generate(tmp_path):
    model = tmp_path / "tiny"
    assert "wrote" in run(str(model), module="tools.tiny").stdout
    for f in ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
              "system_prompt.py"):
        assert (model / f).exists(), f
    out = run("text", "--model", str(model), "--prompt", "a red circle", "--max-new-tokens", "8", "--seed", "3")
    assert "[think]" in out.stdout and "[size]" in out.stdout and "[timings]" in out.stdout
    png = tmp_path / "t2i.png"
    out = run("generate", "--model", str(model), "--prompt", "a red circle", "--bot-task", "image",
              "--size", "256x192", "--steps", "2", "--seed", "1", "--out", str(png))
    assert Image.open(png).size == (192, 256)          # PIL size is (W, H); the request was HxW
    ref = tmp_path / "ref.png"
    Image.new("RGB", (300, 200), (200, 30, 30)).save(ref)
    png2 = tmp_path / "ti2i.png"
    run("generate", "--model", str(model), "--prompt", "make it blue", "--image", str(ref), "--max-new-tokens", "6",
        "--steps", "2", "--seed", "1", "--out", str(png2))
    assert Image.open(png2).size[0] > 0


def test_bad_input_is_refused_with_a_message(tmp_path, tiny_dir):
    p = run("generate", "--model", str(tiny_dir), "--prompt", " ", "--out", str(tmp_path / "x.png"), check=False)
    assert p.returncode == 2 and "prompt is empty" in p.stderr
    p = run("text", "--model", str(tmp_path / "missing"), "--prompt", "x", check=False)
    assert p.returncode == 2 and "does not exist" in p.stderr


def test_bad_values_are_refused_before_the_model_loads(tmp_path, tiny_dir):
    """Issue 43 item 5: --steps 0, --size 5x5x5 and a missing --image are refused naming the flag, before any
    weight is read: on a folder with the checkpoint's small files and no weight shards, the refusal comes
    (loading first failed on the missing shards, or on a real checkpoint took a whole 80B load to say it)."""
    small = tmp_path / "no-weights"
    small.mkdir()
    for f in tiny_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            (small / f.name).write_bytes(f.read_bytes())
    base = ("generate", "--model", str(small), "--prompt", "a red circle", "--out", str(tmp_path / "x.png"))
    for extra, words in ((("--steps", "0"), "error: --steps: steps must be an integer from 1 to 200 (got 0)"),
                         (("--size", "5x5x5"), "error: --size: size '5x5x5' is not understood"),
                         (("--image", str(tmp_path / "in.png")), "error: --image: reference image 1: file")):
        p = run(*base, *extra, check=False)
        assert p.returncode == 2 and words in p.stderr, p.stderr[-1000:]
        assert "cannot load" not in p.stderr and "loading" not in p.stderr.lower(), p.stderr[-1000:]


@pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="no embedded model in assets/")
def test_generate_defaults_to_the_embedded_model_and_says_width_first(tmp_path):
    png = tmp_path / "out.png"
    out = run("generate", "--prompt", "a red circle", "--steps", "2", "--seed", "1", "--out", str(png))
    w, h = Image.open(png).size
    assert f"[size] {w} x {h} (width x height" in out.stdout
    assert f"[image] {w} x {h} written to" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_refused_at_start_in_one_sentence(tmp_path, tiny_dir):
    """The CLI and the studio refuse --device cuda before loading or serving anything (the CLI used to
    end in a traceback; the studio served the page, then failed every request)."""
    cli = run("generate", "--model", str(tiny_dir), "--prompt", "x", "--device", "cuda", "--out",
              str(tmp_path / "x.png"), check=False)
    app = subprocess.run([sys.executable, "app.py", "--model", str(tiny_dir), "--device", "cuda"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    for p in (cli, app):
        assert p.returncode == 2, p.stderr[-2000:]
        assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "Traceback" not in p.stderr, p.stderr
        assert "--device cuda was asked for, but this machine has no CUDA GPU" in p.stderr
        assert "run with --device cpu" in p.stderr
    assert "studio: open" not in app.stdout


def test_the_studio_without_its_embedded_model_names_the_folder(tmp_path, monkeypatch, capsys):
    """The embedded model ships with the repository: without it `python app.py` ends with one line naming the
    missing folder (it used to make a tiny random checkpoint with tools/, which the run time never imports)."""
    import app
    missing = tmp_path / "assets" / "model"
    monkeypatch.setattr(app, "EMBEDDED_MODEL", missing)
    monkeypatch.setattr(app.signal, "signal", lambda *a: None)          # main's SIGTERM handler: not in pytest
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    assert app.main([]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: the embedded model is missing: {missing} has no config.json (it "
                                        "ships with the repository under assets/model); restore it, or start "
                                        "with --model DIR"]


def readme_commands() -> list[str]:
    """The README's command-line examples: every `python -m engine` / `python -m tools.tiny` line of the bash
    blocks of its first two sections after the set-up (trying the model, then the engine's command line)."""
    import re
    text = (ROOT / "README.md").read_text()
    start, end = text.index("## Open the page and try it"), text.index("## Studio")
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text[start:end], re.S):
        lines += [ln.split("  #")[0].strip() for ln in block.splitlines()
                  if ln.startswith(("python -m engine ", "python -m tools.tiny "))]
    return lines


@pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="no embedded model in assets/")
def test_the_readme_command_line_examples_run_as_written(tmp_path, capsys):
    """Issue 43 item 6: each example runs as written, in order (an edit's --image is an earlier line's output;
    the README's `--image in.png` named a file nobody had), the first ones on the embedded model. Only /tmp
    is moved to this test's folder; in-process, so the model's load is the only start-up cost."""
    import shlex
    from engine.__main__ import main as engine_main
    from tools.tiny import main as tiny_main
    lines = readme_commands()
    assert len(lines) >= 5 and "--model" not in lines[0] and lines[1].startswith("python -m engine text")
    for line in lines:
        argv = [a.replace("/tmp/", f"{tmp_path}/") for a in shlex.split(line)[3:]]
        rc = (tiny_main if line.startswith("python -m tools.tiny") else engine_main)(argv)
        out = capsys.readouterr().out
        assert rc == 0, (line, out[-2000:])
        if line.startswith("python -m engine text"):
            assert "[think] " in out and "[recaption] " in out and "[size] " in out, out
    assert Image.open(tmp_path / "edit.png").format == "PNG"
