"""Every EAGLE-3 draft in the field: read the formats other tools publish, write the ones engines load.

The package: ``common`` (format names, ``FormatError``, ``ReadNote``, file readers), ``detect``
(which format a folder holds), ``readers`` (``read_draft`` and one reader per format),
``normalise`` (the checks and inferences every format goes through) and ``writers``
(``write_draft``, ``convert``, ``as_ours``).

One entry point, ``read_draft(path, target_config=None)``, returns our ``Eagle3Draft`` plus a
``ReadNote`` saying which format it saw and every value it had to infer. ``write_draft`` writes
ours (which vLLM and SGLang both load as-is, docs/design.md §5) or the speculators format.
The formats, what each reader infers and which engine loads what: docs/formats.md.

Each reader follows what the producing project's code writes (file and version named below):

- ``ours``: this package's ``export.save_draft`` (config.json + model.safetensors, both layer-id keys).
- ``eagle``: the EAGLE reference (SafeAILab/EAGLE ``eagle/traineagle3/cnets.py``, ``config.json``):
  ``pytorch_model.bin`` pickle, our tensor names, layer ids not recorded (the reference code
  captures the default (2, N//2, N-3)), sometimes no d2t/t2d for a full vocabulary.
- ``speculators``: vLLM's speculators format (speculators 0.9.0 ``models/eagle3/config.py``,
  ``convert/eagle/eagle3_converter.py``; vLLM 0.32.0 ``transformers_utils/configs/speculators/algos.py``):
  ``Eagle3Speculator`` with ``transformer_layer_config``, ``speculators_config``, top-level
  ``draft_vocab_size`` / ``eagle_aux_hidden_state_layer_ids``, ``layers.0.*`` names, and
  ``norm_before_residual`` that vLLM defaults to True when the key is missing.
- ``modelopt``: NVIDIA ModelOpt 0.47.0 ``torch/export/plugins/hf_spec_export.py``: ``layers.0.*``
  names, ``d2t`` without ``t2d`` (and no d2t at all for a full vocabulary), ids only in
  ``eagle_config`` in the "output of layer k" count, RoPE scaling injected at export
  (``eagle_export_rope_scaling``).
- ``specforge``: SpecForge 0.2.0 ``export/to_sglang.py``: our names, ``embed_tokens`` dropped,
  layer ids only in ``eagle_config`` (SGLang adds one) or, when the run set them, nowhere.

Safety: a ``.bin`` is loaded with ``torch.load(weights_only=True)`` only, and no code from a
draft repository is ever run; a file that needs more is refused with one line naming it.
"""

