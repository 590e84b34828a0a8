"""The syncer's read-back: does an engine serve the parameters of the file it was given?

After an update whose ``weight_version`` checks out, the syncer reads a few parameters back
(SGLang's ``POST /get_weights_by_name {"name", "truncate_size"}``, which the local engine
serves too) and compares them with the same slices of the file. An engine may serve in a
narrower dtype than the file (bf16 or fp16 from an fp32 file), so a value matches when it is
the file's value rounded to a 16-bit float: |served - file| <= 2^-8 * |file| (bf16 keeps 8
significant bits, so its rounding error is at most half a unit in the 8th bit, 2^-9 relative;
fp16 keeps 11). Weights of another version or run differ far beyond that in all but a few
entries, so the check asks that no compared entry differ by more. What it cannot see: two
versions whose difference in the compared slices is within a 16-bit rounding (a tiny learning
rate, read back from a 16-bit engine): the ``weight_version`` check is the one guard there.

vLLM serves no such read: its ``/weight_checker`` digests every served parameter instead, and
``checksum_mismatch`` compares those digests with the file's bytes (in the file's dtype or a
16-bit one) for the parameters both name alike. vLLM's CPU build repacks its linear layers and
digests them empty, so there only the embeddings and norms are compared, and
``probe_mismatch`` vouches for the rest: vLLM's log-probs of a fixed text (PROBE_TEXT) against
the file's own, computed here in fp32 with the engine's model configuration. They agree within
PROBE_TOLERANCE (the suite's vLLM tier bounds fp32 vLLM against transformers by 1e-3 and
measured 3.1e-5); linear layers left as they were move them by more unless the update itself
moved the probe by less than that (a tiny learning rate), which this check cannot see.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from agentarium.schemas import WeightIdentity

from ..control import EngineControl, EngineControlError

READ_ROWS = 2  # truncate_size: the first rows of each parameter read back
RELATIVE = 2.0**-8  # a 16-bit engine's rounding of the file's value (module docstring)
ABSOLUTE = 2.0**-24  # values that round to zero or a subnormal in fp16


def pick_names(names: list[str]) -> list[str]:
    """Up to three parameters to read back: the first and last layer's MLP down projection and
    the final norm when the model has them (every architecture we serve names them so), else
    the first and last names. Sorted names, so both sides pick the same."""
    ordered = sorted(names)
    down = [n for n in ordered if n.endswith("mlp.down_proj.weight")]
    picks = [down[0], down[-1]] if down else []
    picks += [n for n in ordered if n == "model.norm.weight"]
    if not picks:
        picks = [ordered[0], ordered[-1]] if ordered else []
    return list(dict.fromkeys(picks))


def expected_slices(file: Path) -> dict[str, list]:
    """The first ``READ_ROWS`` rows of the picked parameters of a safetensors file, as floats."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        names = pick_names(list(f.keys()))
        return {n: f.get_slice(n)[:READ_ROWS].float().tolist() for n in names}


def _flatten(value: Any) -> list[float]:
    if isinstance(value, list):
        return [x for v in value for x in _flatten(v)]
    return [float(value)]


def compare(name: str, expected: Any, served: Any) -> str:
    """ "" when ``served`` is ``expected`` up to a 16-bit rounding, else the first difference."""
    want, got = _flatten(expected), _flatten(served)
    if len(want) != len(got):
        return f"{name}: read back {len(got)} values, the file has {len(want)}"
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        if abs(g - w) > RELATIVE * abs(w) + ABSOLUTE:
            return f"{name}[{i}]: serves {g!r}, the file has {w!r}"
    return ""


async def read_back_mismatch(
    control: EngineControl, url: str, model_dir: Path, target: WeightIdentity
) -> str:
    """ "" when the engine's parameters match ``model_dir``'s file, else what differs."""
    files = sorted(model_dir.glob("*.safetensors"))
    if len(files) != 1:
        return ""  # not a file the syncer made: nothing to compare against
    expected = await asyncio.to_thread(expected_slices, files[0])
    for name, values in expected.items():
        try:
            served = await control.get_weights_by_name(url, name, READ_ROWS)
        except EngineControlError as exc:
            return f"serves {str(target)!r} but its weights could not be read back: {exc}"
        problem = compare(name, values, served)
        if problem:
            return f"reports {str(target)!r} but does not serve its weights: {problem}"
    return ""


# SHA-256 of no bytes: what vLLM's CPU build reports for the parameters it repacked into its own
# kernels' format, leaving the original empty (VLLM_API.md, "The CPU build's blind spot")
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: rows of its vocabulary tensors


def file_digests(file: Path, names: set[str]) -> dict[str, set[str]]:
    """SHA-256 of the raw bytes of ``names`` in a safetensors file, in the file's dtype and in
    each dtype an engine may serve it in (fp32, bf16, fp16): a served tensor matches when its
    digest is one of them. A 2-D tensor whose rows are not a multiple of VOCAB_PADDING also
    matches zero-padded to the next multiple: vLLM pads its embedding and output head to that
    many rows and zero-fills the rest (a 263-token vocabulary is served as 320 rows)."""
    import hashlib

    import torch
    from safetensors import safe_open

    out: dict[str, set[str]] = {}
    with safe_open(str(file), framework="pt") as f:
        for name in sorted(names & set(f.keys())):
            tensor = f.get_tensor(name)
            forms = [tensor]
            if tensor.dim() == 2 and tensor.shape[0] % VOCAB_PADDING:
                pad = VOCAB_PADDING - tensor.shape[0] % VOCAB_PADDING
                forms.append(torch.cat([tensor, tensor.new_zeros((pad, tensor.shape[1]))]))
            out[name] = {
                hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                for form in forms
                for t in (form, *(form.to(d) for d in (torch.float32, torch.bfloat16, torch.float16)))
            }  # fmt: skip
    return out


async def checksum_mismatch(
    control: EngineControl, url: str, model_dir: Path, target: WeightIdentity
) -> str:
    """vLLM's check: "" when every parameter its ``/weight_checker`` digests (its empty ones
    aside) and the file holds under the same name has the file's bytes, else what differs.
    Names vLLM fuses (``qkv_proj``, ``gate_up_proj``) are not in the file and are not
    compared; on the CPU build the linear layers' digests are empty, so what is compared is
    the embeddings and the norms."""
    try:
        served = await control.weight_checksums(url)
    except EngineControlError as exc:
        return f"serves {str(target)!r} but its weights could not be checked: {exc}"
    return await _digest_mismatch(served, model_dir, target)


async def vllm_mismatch(
    control: EngineControl, url: str, model_dir: Path, base: Path | None, target: WeightIdentity
) -> str:
    """The syncer's check of vLLM: its digests (as ``checksum_mismatch``, one
    ``/weight_checker`` call), then, where it digests some parameter empty (the CPU build's
    linear layers), the probe (``probe_mismatch``) for what the digests cannot see."""
    try:
        served = await control.weight_checksums(url)
    except EngineControlError as exc:
        return f"serves {str(target)!r} but its weights could not be checked: {exc}"
    problem = await _digest_mismatch(served, model_dir, target)
    if problem or EMPTY_SHA256 not in served.values():
        return problem
    return await probe_mismatch(control, url, model_dir, base, target)


async def _digest_mismatch(served: dict[str, str], model_dir: Path, target: WeightIdentity) -> str:
    files = sorted(model_dir.glob("*.safetensors"))
    if len(files) != 1:
        return ""
    digested = {n for n, d in served.items() if d != EMPTY_SHA256}
    expected = await asyncio.to_thread(file_digests, files[0], digested)
    if not expected:
        return ""  # nothing comparable: the weight_version check is the one guard
    for name, digests in expected.items():
        if served[name] not in digests:
            return f"reports {str(target)!r} but does not serve its weights: {name} differs"
    return ""


PROBE_TEXT = (
    "The weights of a policy change with every step of training. What is 12 + 35? The answer is 47."
)
PROBE_TOLERANCE = 1e-3  # module docstring


def probe_expected(model_dir: Path, base: Path) -> tuple[list[int], list[float]]:
    """PROBE_TEXT's ids (``base``'s tokenizer) and their log-probs under ``model_dir``'s
    weights in ``base``'s architecture, fp32, each after the ones before it."""
    import tempfile

    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    ids = Tokenizer.from_file(str(base / "tokenizer.json")).encode(PROBE_TEXT).ids
    with tempfile.TemporaryDirectory() as tmp:  # the file beside the engine's config
        (Path(tmp) / "config.json").symlink_to(base / "config.json")
        for file in model_dir.glob("*.safetensors"):
            (Path(tmp) / file.name).symlink_to(file.resolve())
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    picked = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return ids, picked.tolist()


async def probe_mismatch(
    control: EngineControl, url: str, model_dir: Path, base: Path | None, target: WeightIdentity
) -> str:
    """ "" when vLLM's log-probs of PROBE_TEXT are the file's within PROBE_TOLERANCE, else what
    differs (module docstring). Also "" when there is no ``base`` directory with a tokenizer
    and a configuration to build the model from: the digests are then the one check."""
    if base is None or not (base / "tokenizer.json").is_file():
        return ""
    ids, expected = await asyncio.to_thread(probe_expected, model_dir, base)
    try:
        served = await control.prompt_logprobs(url, ids)
    except EngineControlError as exc:
        return f"serves {str(target)!r} but its weights could not be probed: {exc}"
    worst = max(abs(a - b) for a, b in zip(served, expected, strict=True))
    if worst > PROBE_TOLERANCE:
        return (
            f"reports {str(target)!r} but does not serve its weights: its log-probs of the probe "
            f"differ from the file's by up to {worst:.3g} (tolerance {PROBE_TOLERANCE:g})"
        )
    return ""
