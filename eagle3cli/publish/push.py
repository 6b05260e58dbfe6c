"""Publish a draft directory as a Hub repo that SGLang and vLLM load unchanged.

The repo holds exactly ``UPLOAD_FILES``: the draft's ``config.json`` and ``model.safetensors``
as they are, the model card ``README.md`` (model_card.py) and ``eagle3_training.json`` (the
config's ``eagle3_training`` block on its own, easy to read without parsing the engine config).

The folder is built first (``build_folder``), then uploaded in one commit with huggingface_hub
(``create_repo`` + ``upload_folder``). ``--dry-run`` stops after building it. A draft that fails
``inspector.inspect_draft`` is never published. The token goes to huggingface_hub only: it is
never written to a file or printed (error messages are scrubbed of it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable

from rich.console import Console

from ..core.errors import Eagle3Error
from ..core.io_utils import atomic_dir, atomic_path, ensure_dir, write_text
from .export import CONFIG, METADATA_KEY, WEIGHTS

TRAINING_FILE = "eagle3_training.json"
CARD = "README.md"
UPLOAD_FILES = (CONFIG, WEIGHTS, CARD, TRAINING_FILE)
GGUF_FILES = "draft-*.gguf"  # with --gguf TYPE: the draft for llama.cpp (gguf_export.py)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
RETRY_STATUS = {408, 429, 500, 502, 503, 504}
TRIES, WAIT_S = 4, 2.0  # network retries per Hub call: waits 2, 4, 8 s

console = Console(stderr=True)


class PushError(Eagle3Error, RuntimeError):
    """A push that cannot go on; the message is one line that says what to do."""


class DraftRejected(PushError):
    def __init__(self, draft_dir, problems: list[str]):
        self.problems = list(problems)
        more = f" (+{len(problems) - 1} more found by `eagle3 inspect`, listed above)" if len(problems) > 1 else ""
        super().__init__(f"refusing to publish {draft_dir}: {problems[0] if problems else 'it fails inspect'}{more}")


@dataclass
class PushResult:
    repo_id: str
    folder: Path | None = None  # the dry-run folder (None after an upload: it was temporary)
    files: list[str] = field(default_factory=list)
    repo_url: str | None = None
    commit_url: str | None = None
    pr_url: str | None = None
    note: str = ""


# ---------------------------------------------------------------- building the folder

def inspected_config(draft_dir: str | Path) -> dict:
    """Gate: the draft must pass inspect. Returns its config.json."""
    from .export import read_config
    from .inspector import inspect_draft

    rep = inspect_draft(draft_dir)
    if not rep.ok:
        raise DraftRejected(draft_dir, rep.problems)
    return read_config(draft_dir)


def is_hub_id(name: str | None) -> bool:
    """OWNER/NAME that is not also a local path (a local folder is never a base_model)."""
    return bool(name) and bool(HUB_ID.match(name)) and not Path(name).exists()


def resolve_target(config: dict, base_model: str | None = None) -> str:
    """The target's Hub id: --base-model, else what training recorded (if it is a Hub id)."""
    target = (config.get(METADATA_KEY) or {}).get("target")
    if not target and not base_model:
        raise PushError("the draft's config.json records no target model; pass --base-model OWNER/NAME")
    return hub_id_of(target, base_model)


def hub_id_of(target: str | None, base_model: str | None = None,
              local: str = "the draft was trained on the local folder") -> str:
    """The Hub id of ``target``: ``base_model`` when given (checked), ``target`` if it is a Hub id,
    else the Hub id a known local conversion came from; a local folder of unknown origin is an
    error saying what to pass (``local`` words its start)."""
    if base_model:
        if not HUB_ID.match(base_model):
            raise PushError(f"--base-model {base_model!r} is not a Hub id (OWNER/NAME)")
        return base_model
    if is_hub_id(target):
        return target
    known = _converted_hub_id(target)
    if known:
        console.print(f"base model: {known} (the Hub model that {target} was converted from; "
                      "--base-model overrides)", highlight=False)
        return known
    raise PushError(f"{local} {target}; pass --base-model OWNER/NAME "
                    f"(its Hub id{_hub_id_hint(target)}) so the card and the serving commands name it")


def _converted_hub_id(folder: str) -> str | None:
    """The Hub id of a real model that realmodels.py converted into ``folder`` (its SOURCE.txt says so)."""
    from ..core.realmodels import SMOLLM2_HUB_ID, SMOLLM2_NAME

    source = Path(folder) / "SOURCE.txt"
    if Path(folder).name == SMOLLM2_NAME and source.is_file() and "eagle3cli.core.realmodels" in source.read_text():
        return SMOLLM2_HUB_ID
    return None


def _hub_id_hint(folder: str) -> str:
    # The real models that eagle3 converts from PyPI wheels (realmodels.py) land in a folder named
    # after the Hub model; say which id that is, but let the user confirm it.
    from ..core.realmodels import SMOLLM2_HUB_ID, SMOLLM2_NAME

    return f", probably {SMOLLM2_HUB_ID}" if Path(folder).name == SMOLLM2_NAME else ""


def load_eval_results(paths, target: str, config: dict) -> list[dict]:
    from .model_card import load_results

    out = []
    trained_on = (config.get(METADATA_KEY) or {}).get("target")
    for p in paths:
        try:
            res = load_results(p)
        except ValueError as e:
            raise PushError(str(e)) from None
        if res.get("target") and res["target"] not in (target, trained_on):
            console.print(f"[yellow]warning:[/] {p} was measured with target {res['target']!r}, "
                          f"the draft's target is {target!r}", highlight=False)
        out.append(res)
    return out


def _link_or_copy(src: Path, dst: Path):
    # A hard link costs nothing for multi-GB weights; save_draft replaces files rather than
    # writing into them, so the link never sees a later re-export.
    try:
        os.link(src, dst)
    except OSError:
        with atomic_path(dst) as tmp:
            shutil.copy2(src, tmp)


def _is_local_path(value) -> bool:
    return isinstance(value, str) and (value.startswith(("/", ".", "~")) or value.count("/") > 1
                                       or ("/" in value and not HUB_ID.match(value)))


def public_config(config: dict, target: str, dataset_ids=()) -> dict:
    """The config as published: the training record names the target's and the data's Hub ids,
    never a path of the machine the draft was trained on (a local path is replaced or dropped)."""
    for d in dataset_ids:
        if not HUB_ID.match(d):
            raise PushError(f"--dataset-id {d!r} is not a Hub id (OWNER/NAME)")
    meta = dict(config.get(METADATA_KEY) or {})
    if meta.get("target") != target:
        meta["target"] = target
    if dataset_ids:
        meta["datasets"] = list(dataset_ids)
    if _is_local_path(meta.get("data")):
        meta.pop("data")  # the store's folder, as earlier versions recorded it
    if _is_local_path(meta.get("recipe")):
        meta["recipe"] = Path(meta["recipe"]).name  # a --recipe YAML file: its name only
    return config if meta == (config.get(METADATA_KEY) or {}) else {**config, METADATA_KEY: meta}


def build_folder(draft_dir: str | Path, out_dir: str | Path, repo_id: str, eval_results=(),
                 license: str | None = None, base_model: str | None = None, dataset_ids=(), gguf=None) -> list[str]:
    """Write the upload folder for ``repo_id`` into the (empty or new) ``out_dir``."""
    draft, out = Path(draft_dir), Path(out_dir)
    if not HUB_ID.match(repo_id or ""):
        raise PushError(f"--repo {repo_id!r}: expected OWNER/NAME (the card's serving commands need the full id)")
    config = inspected_config(draft)
    target = resolve_target(config, base_model)
    results = load_eval_results(eval_results, target, config)
    public = public_config(config, target, dataset_ids)

    from ..core.io_utils import write_json
    from .model_card import render_card

    card = render_card(public, repo_id, target, results, license=license,
                       gguf_files=[f"draft-{t}.gguf" for t in gguf.outtypes] if gguf else ())
    ensure_dir(out)
    if public is config:
        with atomic_path(out / CONFIG) as tmp:
            shutil.copyfile(draft / CONFIG, tmp)  # byte for byte: what inspect checked
    else:
        write_json(out / CONFIG, public)  # only the training record differs from what inspect checked
    _link_or_copy(draft / WEIGHTS, out / WEIGHTS)
    write_text(out / TRAINING_FILE, json.dumps(public.get(METADATA_KEY) or {}, indent=2) + "\n")
    write_text(out / CARD, str(card))  # what ModelCard.save writes
    if gguf:
        from .gguf_export import GGUFExportError, export_gguf

        for t in gguf.outtypes:
            try:
                export_gguf(draft, out, t, target_dir=gguf.target_dir, target_gguf=gguf.target_gguf,
                            llama_cpp=gguf.llama_cpp)
            except GGUFExportError as e:
                raise PushError(f"--gguf {t}: {e}") from None
    return sorted(p.name for p in out.iterdir())


# ---------------------------------------------------------------- dry run

def _sha256(path: Path) -> str:
    from ..core.io_utils import file_sha256

    return file_sha256(path)


def _same_engine_config(a: Path, b: Path) -> bool:
    """The same config apart from the training record (which publishing may rewrite)."""
    try:
        ca, cb = (json.loads(p.read_text()) for p in (a, b))
    except (OSError, ValueError):
        return False
    return isinstance(ca, dict) and isinstance(cb, dict) and \
        {k: v for k, v in ca.items() if k != METADATA_KEY} == {k: v for k, v in cb.items() if k != METADATA_KEY}


def _same_file_content(a: Path, b: Path) -> bool:
    if not (a.is_file() and b.is_file()):
        return False
    if os.path.samefile(a, b):
        return True
    return a.stat().st_size == b.stat().st_size and _sha256(a) == _sha256(b)


def dry_run_decision(draft_dir: str | Path, out_dir: str | Path) -> str:
    """Whether ``out_dir`` may receive the dry run; returns what was chosen, raises if not.

    Allowed: a new or empty folder, or an earlier dry run of the same draft (only our files,
    a card, and config.json and weights identical to the draft's), which is replaced.
    """
    draft, out = Path(draft_dir).resolve(), Path(out_dir).resolve()
    if out == draft or draft in out.parents or out in draft.parents:
        raise PushError(f"--dry-run {out_dir}: must be a folder outside the draft directory")
    if not out.exists():
        return f"writing a new folder {out_dir}"
    if not out.is_dir():
        raise PushError(f"--dry-run {out_dir}: exists and is not a folder")
    names = {p.name for p in out.iterdir()}
    if not names:
        return f"writing into the empty folder {out_dir}"
    earlier = ({n for n in names if not fnmatch(n, GGUF_FILES)} <= set(UPLOAD_FILES) and CARD in names
               and _same_engine_config(out / CONFIG, draft / CONFIG)
               and _same_file_content(out / WEIGHTS, draft / WEIGHTS))
    if not earlier:
        raise PushError(f"--dry-run {out_dir}: folder is not empty and is not an earlier dry run of this draft; "
                        "give a new or empty folder")
    return f"replacing the earlier dry run of this draft in {out_dir}"


def dry_run(draft_dir, out_dir, repo_id: str, eval_results=(), license=None, base_model=None,
            dataset_ids=(), gguf=None) -> PushResult:
    """Write exactly the folder ``push`` would upload, and upload nothing."""
    note = dry_run_decision(draft_dir, out_dir)
    out = Path(out_dir)
    # Built beside the destination, then swapped in (an earlier dry run of this draft, or an empty
    # folder, is replaced): a failed build never leaves half a folder. Not mkdtemp: its 0700 mode
    # would stick to OUT_DIR.
    with atomic_dir(out) as tmp:
        files = build_folder(draft_dir, tmp, repo_id, eval_results, license, base_model, dataset_ids, gguf)
    return PushResult(repo_id=repo_id, folder=out, files=files, note=note)


# ---------------------------------------------------------------- upload

def _scrub(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text


def _network_errors() -> tuple[type[BaseException], ...]:
    """Transport-level failures of whichever HTTP client this huggingface_hub uses."""
    errs: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for mod, name in (("httpx2", "TransportError"), ("httpx", "TransportError"),
                      ("requests", "ConnectionError"), ("requests", "Timeout")):
        try:
            errs.append(getattr(__import__(mod), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errs)


def _status(err: BaseException) -> int | None:
    resp = getattr(err, "response", None)
    return getattr(resp, "status_code", None)


def _explain(err: BaseException, what: str, endpoint: str) -> str:
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(err, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set: unset it to upload (or use --dry-run OUT_DIR)"
    status = _status(err)
    if isinstance(err, HfHubHTTPError) and status in (401, 403):
        return (f"{what} refused by {endpoint} (HTTP {status}): log in with `hf auth login`, set HF_TOKEN or "
                "pass --token with a token that has write access to this repo")
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"{what} failed: {first}"


def with_retries(what: str, fn: Callable, tries: int | None = None, wait_s: float | None = None,
                 endpoint: str = "the Hub", token: str | None = None):
    """Call fn(); retry network errors and 408/429/5xx with backoff, then fail with one line."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    tries = TRIES if tries is None else tries
    wait_s = WAIT_S if wait_s is None else wait_s
    network = _network_errors()
    for attempt in range(1, tries + 1):
        try:
            return fn()
        except OfflineModeIsEnabled as e:
            raise PushError(_explain(e, what, endpoint)) from None
        except Exception as e:  # noqa: BLE001 - sorted below; anything else is re-raised as is
            transient = (_status(e) in RETRY_STATUS) if isinstance(e, HfHubHTTPError) else isinstance(e, network)
            if not transient:
                if isinstance(e, (HfHubHTTPError, ValueError)):
                    raise PushError(_scrub(_explain(e, what, endpoint), token)) from None
                raise
            short = _scrub(str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__, token)
            if attempt == tries:
                raise PushError(f"{what}: network error talking to {endpoint} after {tries} tries ({short}); "
                                "nothing is lost: run the same command again to finish") from None
            delay = wait_s * 2 ** (attempt - 1)
            console.print(f"[yellow]{what}: {short}; retry {attempt}/{tries - 1} in {delay:g}s[/]", highlight=False)
            time.sleep(delay)


def upload(folder: str | Path, repo_id: str, *, private: bool = False, branch: str | None = None,
           create_pr: bool = False, token: str | None = None, commit_message: str | None = None,
           tries: int | None = None, wait_s: float | None = None) -> PushResult:
    """create_repo(exist_ok) + create_branch + upload_folder, each retried on network errors.

    Every step is idempotent (the repo and branch may exist, unchanged files are skipped), so
    running the same push again completes one that failed half-way.
    """
    from huggingface_hub import HfApi

    if create_pr and branch not in (None, "main"):
        raise PushError("--create-pr opens a pull request against main; drop --branch (or --create-pr)")
    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or None  # read now, not at import
    api = HfApi(endpoint=endpoint, token=token)
    where = api.endpoint
    retry = dict(tries=tries, wait_s=wait_s, endpoint=where, token=token)

    repo_url = with_retries("create repo", lambda: api.create_repo(
        repo_id, private=True if private else None, exist_ok=True, repo_type="model"), **retry)
    if private:
        info = with_retries("read repo", lambda: api.repo_info(repo_id, repo_type="model"), **retry)
        if info.private is False:
            raise PushError(f"{repo_id} already exists and is public; --private does not change that: "
                            "make it private on the Hub first, or drop --private")
    if branch and branch != "main" and not branch.startswith("refs/pr/"):
        with_retries("create branch", lambda: api.create_branch(
            repo_id, branch=branch, exist_ok=True, repo_type="model"), **retry)
    commit = with_retries("upload", lambda: api.upload_folder(
        repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=branch, create_pr=create_pr,
        commit_message=commit_message or f"Upload EAGLE-3 draft ({', '.join(UPLOAD_FILES)})",
        allow_patterns=[*UPLOAD_FILES, GGUF_FILES]), **retry)
    return PushResult(repo_id=repo_id, files=sorted(UPLOAD_FILES), repo_url=str(repo_url),
                      commit_url=getattr(commit, "commit_url", None), pr_url=getattr(commit, "pr_url", None))


def require_token(token: str | None) -> str:
    """--token, else HF_TOKEN or the saved login; checked before any network call or work."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise PushError("no Hub token: log in with `hf auth login`, set HF_TOKEN or pass --token "
                        "(--dry-run OUT_DIR needs none)")
    return token


def _scratch_parent(draft_dir) -> str | None:
    # Beside the draft, the weights can be hard-linked instead of copied; else the system temp.
    parent = Path(draft_dir).resolve().parent
    return str(parent) if os.access(parent, os.W_OK) else None


def push(draft_dir, repo_id: str, *, private: bool = False, branch: str | None = None, create_pr: bool = False,
         token: str | None = None, eval_results=(), commit_message: str | None = None, license: str | None = None,
         base_model: str | None = None, tries: int | None = None, wait_s: float | None = None,
         dataset_ids=(), gguf=None) -> PushResult:
    """Build the folder in a temporary directory and upload it."""
    token = require_token(token)
    with tempfile.TemporaryDirectory(prefix=".eagle3-push-", dir=_scratch_parent(draft_dir)) as tmp:
        files = build_folder(draft_dir, tmp, repo_id, eval_results, license, base_model, dataset_ids, gguf)
        res = upload(tmp, repo_id, private=private, branch=branch, create_pr=create_pr, token=token,
                     commit_message=commit_message, tries=tries, wait_s=wait_s)
    res.files = files
    return res
