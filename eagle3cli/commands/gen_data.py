"""`eagle3 gen-data`: chat prompts -> the target's own answers -> masks -> features on disk.

The flags are the fields of ``GenDataOptions`` (eagle3cli/config/options.py), the target's first.
"""

from __future__ import annotations

from ..config.options import GenDataOptions
from . import common


@common.flags_from(GenDataOptions, required=("model",))
def gen_data(**flags):
    """Build training data: the target answers chat prompts, masks cover its answers, features go to disk."""
    from ..config.options import from_flags

    opts = from_flags(GenDataOptions, flags)
    opts.validate()  # every flag, before the library (torch, transformers) is imported
    from ..core.errors import Interrupted
    from ..data.gen_data import run
    from ..model.target import TargetSpec

    try:
        man = run(opts, TargetSpec.of(opts), common.console)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted: finished shards in {opts.out} are kept; run the same command again "
                          "to resume") from None
    if man is not None:  # None: --dry-run
        common.console.print(summary(opts.out, man), highlight=False)


def summary(out, man: dict) -> str:
    """The one line that says what the run wrote."""
    from ..data.estimates import human_bytes

    state = "complete" if man["complete"] else f"{man['shards_done']}/{man['shards_planned']} shards done"
    return (f"[green]wrote[/] {out}: {man['num_samples']} samples, {man['num_tokens']:,} tokens "
            f"({man['num_masked_tokens']:,} learned), {human_bytes(man['bytes'])}, {man['truncated']} truncated, "
            f"skipped {sum(man['skipped'].values())}; {state}")
