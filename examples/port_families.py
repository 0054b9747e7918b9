"""Port every MoE family transformers registers with ``rules/klotski.yaml`` alone and write the
result table (``docs/families.md``): experts layout, router, attention / mixer kinds, the stacks of
blocks found, and whether greedy tokens are identical to the untouched model with the experts on
the host tier and, loaded by ``kinject.from_pretrained`` from the family's own checkpoint, on disk.
A second table holds the multimodal and encoder-decoder families (``kinject.modal_families``):
their modality, the inputs given (a real image through the family's own processor, a video or
audio clip, an encoder sequence), the stacks in run order, and the tokens with the whole rule file.

    python examples/port_families.py docs/families.md            # regenerate (after a transformers upgrade)
    python examples/port_families.py --check docs/families.md    # exit 1 when the table is out of date
    python examples/port_families.py some.md mixtral dbrx       # some families only
    python examples/port_families.py --modal docs/families.md    # the multimodal table only, in place

The host and disk columns leave attention untouched (the rule file's attention rule dropped):
they are about routers and experts. The last column applies the whole file, attention included.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import logging
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import transformers
import yaml

import kinject
from kinject import families, modal_families
from kinject.stacks import find_stacks
from kinject.testing import tiny_batch, tiny_tokenizer
from operators.experts import GroupedExperts
from operators.gate import PrefetchGate

logger = logging.getLogger("port_families")
RULES = Path(__file__).resolve().parents[1] / "rules" / "klotski.yaml"


def _rules(attention: bool = False) -> dict:
    data = yaml.safe_load(RULES.read_text())
    if not attention:
        data["rules"] = [r for r in data["rules"] if not r["replace"]["class"].endswith("OffloadedAttention")]
    return data


def _generate(model) -> torch.Tensor:
    tok = tiny_tokenizer()
    batch = tiny_batch(tok, 4, min_tokens=8)
    return model.generate(**batch, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)


def _placement(model) -> tuple[str, str]:
    ops = model.kinject.operators
    experts = [op for op in ops if isinstance(op, GroupedExperts)]
    gates = [op for op in ops if isinstance(op, PrefetchGate)]
    layouts = sorted({f"{op.layout.name} ({op.layout.call}): {type(op.base).__name__}" for op in experts})
    routers = sorted({type(op.base).__name__ for op in gates})
    return "; ".join(layouts) or "-", ", ".join(routers) or "- (lookup experts load what each lookup needs)"


def port(model_type: str, work: Path) -> dict:
    """Build, port on host and from disk; every stage's failure is recorded, never raised."""
    row = {"family": model_type, "layout": "-", "router": "-", "mixers": "-", "stacks": "-", "host": "-", "disk": "-",
           "attention": "-"}
    overrides = ["pipeline.micro_batch_size=2", "pipeline.n_batches=2", f"pipeline.offload_dir={work}/off"]
    try:
        model = families.build_tiny_family_model(model_type)
    except Exception as exc:  # noqa: BLE001
        row["host"] = row["disk"] = f"does not build: {type(exc).__name__}"
        return row
    row["mixers"] = ", ".join(sorted(set(families.mixer_kinds(model))))
    row["stacks"] = _stacks(model)
    ref = _generate(model)
    model.save_pretrained(work / "ckpt")
    try:
        kinject.optimize(model, copy.deepcopy(_rules()), overrides)
        row["layout"], row["router"] = _placement(model)
        row["host"] = "identical" if torch.equal(_generate(model), ref) else "DIFFERENT tokens"
    except Exception as exc:  # noqa: BLE001
        row["host"] = f"fails: {type(exc).__name__}: {str(exc)[:120]}"
    del model
    try:
        ported = kinject.from_pretrained(work / "ckpt", copy.deepcopy(_rules()), overrides + ["vars.weights=disk"],
                                         attn_implementation="eager")
        row["disk"] = "identical" if torch.equal(_generate(ported), ref) else "DIFFERENT tokens"
    except Exception as exc:  # noqa: BLE001
        row["disk"] = f"fails: {type(exc).__name__}: {str(exc)[:160]}"
    try:                                          # the whole file: + OffloadedAttention, KV per micro-batch
        model = families.build_tiny_family_model(model_type)
        kinject.optimize(model, copy.deepcopy(_rules(attention=True)), overrides)
        row["attention"] = "identical" if torch.equal(_generate(model), ref) else "DIFFERENT tokens"
    except Exception as exc:  # noqa: BLE001
        row["attention"] = f"fails: {type(exc).__name__}: {str(exc)[:100]}"
    return row


def _stacks(model) -> str:
    return ", ".join(f"`{s.path}` x{s.length}" for s in find_stacks(model))


def _modal_generate(model, batch, new_tokens: int = modal_families.NEW_TOKENS) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return modal_families.generate_tokens(model, batch, new_tokens)


def _modal_same(model, batches: list[tuple[dict, int]], refs: list[torch.Tensor]) -> str:
    """"identical" where every (batch, new tokens) gives its reference tokens."""
    same = all(torch.equal(_modal_generate(model, batch, new), ref) for (batch, new), ref in zip(batches, refs))
    return "identical" if same else "DIFFERENT tokens"


def _modal_disk(model_type: str, model, batches: list[tuple[dict, int]], refs: list[torch.Tensor], work: Path,
                opts: list[str]) -> str:
    """Tokens of the family's own saved checkpoint loaded by from_pretrained, experts on disk."""
    model.save_pretrained(work / "ckpt")
    attn = modal_families._ATTN_IMPLEMENTATION.get(model_type, "eager")
    try:
        ported = kinject.from_pretrained(work / "ckpt", copy.deepcopy(_rules(attention=True)),
                                         opts + ["vars.weights=disk"], attn_implementation=attn)
        return _modal_same(ported, batches, refs)
    except Exception as exc:  # noqa: BLE001
        return f"fails: {type(exc).__name__}: {str(exc)[:140]}"


def modal_port(model_type: str, modality: str, work: Path) -> dict:
    """Build and port one multimodal / encoder-decoder family with the whole rule file: on the host
    tier in place, then from its own saved checkpoint with experts on disk; every batch of
    :func:`kinject.modal_families.shape_batches` (the family's batches of 3 prompts for 3 tokens, a
    video-only one where the video cannot run beside the image, then 4 text prompts for 8 tokens) must
    give the untouched model's tokens."""
    row = {"family": model_type, "modality": modality, "inputs": "-", "shapes": "-", "stacks": "-", "layout": "-",
           "host": "-", "disk": "-"}
    build = modal_families.build_tiny_seq2seq_model if modality == "seq2seq" else modal_families.build_tiny_modal_model
    try:
        model = build(model_type)
        given = modal_families.shape_batches(model, model_type)
        row["inputs"] = "; ".join(what for what, _, new in given if new == modal_families.NEW_TOKENS)
        row["shapes"] = "; ".join(f"{batch['input_ids'].shape[0]} x {new}" for _, batch, new in given)
        batches = [(batch, new) for _, batch, new in given]
        row["stacks"] = _stacks(model)
        refs = [_modal_generate(model, batch, new) for batch, new in batches]
    except Exception as exc:  # noqa: BLE001
        reason = modal_families.KNOWN_FAILURES.get(model_type, f"{type(exc).__name__}: {str(exc)[:100]}")
        row["host"] = f"untouched model fails tiny: {reason}"
        return row
    opts = ["pipeline.micro_batch_size=2", "pipeline.n_batches=2", f"pipeline.offload_dir={work}/off"]
    row["disk"] = _modal_disk(model_type, model, batches, refs, work, opts)
    try:
        kinject.optimize(model, copy.deepcopy(_rules(attention=True)), opts)
        row["layout"], _ = _placement(model)
        row["host"] = _modal_same(model, batches, refs)
    except Exception as exc:  # noqa: BLE001
        row["host"] = f"fails: {type(exc).__name__}: {str(exc)[:120]}"
    return row


MODAL_HEADING = "## Multimodal and encoder-decoder MoE families"


def modal_table() -> list[str]:
    rows = []
    for name, modality in modal_families.modal_moe_families().items():
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(modal_port(name, modality, Path(tmp)))
        logger.info("%-22s %s", name, rows[-1]["host"])
    return modal_section(rows)


def modal_section(rows: list[dict]) -> list[str]:
    """The multimodal section's lines: the summary, one table row per family, the notes."""
    ok = sum(r["host"] == "identical" for r in rows)
    disk = sum(r["disk"] == "identical" for r in rows)
    images = sum(r["host"] == "identical" and "image" in r["inputs"] for r in rows)
    audio = sum(r["host"] == "identical" and "audio" in r["inputs"] for r in rows)
    video = sum(r["host"] == "identical" and "video" in r["inputs"] for r in rows)
    untouched = sum(r["host"].startswith("untouched") for r in rows)
    out = [
        "", MODAL_HEADING, "",
        "Found by scanning transformers' image-text-to-text, multimodal-LM, seq2seq, speech-seq2seq and "
        "text-to-audio mappings (`kinject.modal_families`): tiny configs with every tower shrunk to 2 blocks "
        "(per-layer lists, per-layer overrides and nested encoder configs cut with them), micro-batches of 2, "
        "the whole rule file (attention, routers, experts), two batch shapes (column *shapes*: prompts x new "
        "greedy tokens per batch): the family's inputs in 3 left-padded prompts (not a multiple of the "
        "micro-batch) for 3 tokens, then 4 text prompts of 10 tokens for 8 -- more than a block of "
        "`diffusion_gemma`'s block diffusion (its tiny `canvas_length` is 4: two blocks, each re-forwarded at "
        "every denoising step over the prefix KV it reads without writing). Images come "
        "from the family's own PIL image processor, else are built from its vision config (patch grid, image "
        "size or single patches); video clips (`pixel_values_videos`) from its vision config: one temporal patch "
        "of frames per clip on a patch grid, else 2 frames through its image processor; audio clips (mel "
        "features, or discretized mel-bin ids) from its audio config where `get_audio_features` takes them; "
        "each item's placeholder tokens are as many as the model's own features for it. Where no placeholder "
        "of the video runs beside the image (the forward refuses each: its video features fill the image "
        "placeholders), the video goes in a second, video-only batch (inputs `image + text; video + text`), "
        "which must give identical tokens too. Tests check that the image (and a video alone in its batch) "
        "changes the untouched model's tokens and the video and audio clips beside it its logits. *host*: optimized in place, "
        "weights on the host tier; *disk*: the family's own checkpoint (`save_pretrained`) loaded by "
        "`kinject.from_pretrained`, experts read from its safetensors on disk. Stacks are listed in the order "
        "kinject numbers them (module tree, towers beside the decoder first); tests check that this is the "
        "order their blocks run.", "",
        f"**{len(rows)} families found; identical tokens: {ok} on the host tier ({images} with a real image per "
        f"prompt, {video} with a video clip, {audio} with an audio clip), {disk} from their own checkpoint with experts on disk; "
        f"{untouched} whose tiny model "
        f"transformers itself cannot run; the rest refused by kinject with the reason given.**", "",
        "| family | modality | inputs | shapes | stacks | experts layout (call): class | host | disk |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"`{r['family']}`", r["modality"], r["inputs"], r.get("shapes", "-"), r["stacks"], r["layout"],
                 r["host"], r["disk"]]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    notes: dict[str, list[str]] = {}
    for reasons in (modal_families.TEXT_ONLY, modal_families.NOT_BUILT, modal_families.PORT_FAILURES,
                    modal_families.DISK_FAILURES):
        for k, v in reasons.items():
            notes.setdefault(k, []).append(v)
    videos = [r["family"] for r in rows if modal_families.takes_video(r["family"]) and "video" not in r["inputs"]]
    if notes:
        out += ["", "Notes:", ""] + [f"- `{k}`: {'; '.join(v)}" for k, v in sorted(notes.items())]
    if videos:
        out += ["", f"Families that take video frames (`pixel_values_videos`) but are given none: "
                    f"{', '.join(f'`{v}`' for v in videos)}."]
    return out


def table(names: list[str], modal: bool = True) -> str:
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(port(name, Path(tmp)))
        logger.info("%-20s host %s, disk %s", name, rows[-1]["host"], rows[-1]["disk"])
    host = sum(r["host"] == "identical" for r in rows)
    disk = sum(r["disk"] == "identical" for r in rows)
    failing = [r for r in rows if r["host"] != "identical" or r["disk"] != "identical"]
    attention = sum(r["attention"] == "identical" for r in rows)
    out = [
        "# MoE families ported by `rules/klotski.yaml`",
        "",
        f"Generated by `python examples/port_families.py docs/families.md` with transformers {transformers.__version__}"
        " (`--check` tells whether it is up to date). Tiny random configs (`kinject.families`), batch 4 in"
        " micro-batches of 2, 3 greedy tokens; router -> `PrefetchGate`, experts -> `GroupedExperts` (one store"
        " unit per expert), shared experts -> `OffloadedModule`, attention untouched.",
        "",
        f"**{len(rows)} families found; identical tokens: {host} with experts on the host tier, {disk} loaded from "
        f"their own checkpoint with experts on disk; {len(failing)} with a failure.** With the file's "
        f"attention rule too (`OffloadedAttention`, KV per micro-batch in kinject's cache, every cache-layer "
        f"kind of the family served per micro-batch; the last column): {attention} of {len(rows)} identical.",
        "",
        "| family | experts layout (call): class | router (PrefetchGate) | attention / mixer kinds | stacks | host "
        "| disk | + attention rule |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"`{r['family']}`", r["layout"], r["router"], r["mixers"], r["stacks"], r["host"], r["disk"],
                 r["attention"]]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    by_layout: dict[str, list[str]] = {}
    for r in rows:
        for part in r["layout"].split("; "):
            by_layout.setdefault(part.split(":")[0], []).append(r["family"])
    out += ["", "## families per experts layout", ""]
    out += [f"- {lay} ({len(fams)}): {', '.join(fams)}" for lay, fams in sorted(by_layout.items(), key=lambda kv: -len(kv[1]))]
    if failing:
        out += ["", "Failures:", ""] + [f"- `{r['family']}`: host {r['host']}; disk {r['disk']}" for r in failing]
    if modal:
        out += modal_table()
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="markdown file to write (or to check with --check)")
    parser.add_argument("families", nargs="*", help="model types (default: every scanned MoE family)")
    parser.add_argument("--check", action="store_true", help="regenerate and compare; exit 1 when they differ")
    parser.add_argument("--modal", action="store_true",
                        help="regenerate the multimodal and encoder-decoder table only, keeping the text tables")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.modal:
        old = args.output.read_text()
        text = old[:old.index(MODAL_HEADING)].rstrip("\n") + "\n" + "\n".join(modal_table()) + "\n"
    else:
        text = table(args.families or families.moe_families(), modal=not args.families)
    if args.check:
        old = args.output.read_text() if args.output.is_file() else ""
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                       str(args.output), "regenerated"))
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
