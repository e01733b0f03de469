"""Propose the table of tested QK-norm fusions for the installed transformers or diffusers, and say what changed.

    python3 tools/qk_norm_table.py            # the differences from rope_ext's table (exit 1 if any)
    python3 tools/qk_norm_table.py --entries  # every entry this release proposes, as the table's lines
    python3 tools/qk_norm_table.py --library diffusers [--entries]   # diffusers' processors

Offline and slow (it runs the rewrite's own analysis, ``_qk_norm_rewrite.probe``, over every
attention method that normalizes q and k and applies RoPE); ``patch()`` never does: it looks each
method's fingerprint up in the table. For each fingerprint the release has, it proposes the site
the rewrite finds (a fusion) or why there is none (``unfusable``), with the families that share
it, and for each new fusion a line for tests/test_qk_norm_fusion.py's CASES: an entry lands in the
table together with the test that runs it, stock against fused.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

from rope_ext.integrations import _qk_norm_rewrite, _qk_norm_table
from rope_ext.integrations import transformers as rope_hf


def proposals() -> tuple[dict, dict, dict]:
    """(fingerprint -> Site, fingerprint -> why unfusable, fingerprint -> [(family, method)])."""
    fused, unfusable, where = {}, {}, collections.defaultdict(list)

    def judge(key, unsupported, node, owner, ropes, attrs):
        return unsupported or _qk_norm_rewrite.probe(node, owner, ropes, attrs)

    root = rope_hf._models_root()
    for family, report in rope_hf.survey().items():
        for module in sorted({fn.module for fn in report.functions}):
            path = os.path.join(root, family, module.rsplit(".", 1)[1] + ".py")
            tree = rope_hf._tree(path, rope_hf._stamp(path))
            functions = [fn for fn in report.functions if fn.module == module]
            for site in rope_hf._fusion_sites(tree, module, functions, judge):
                if site.fused:
                    fused[site.fingerprint] = site.site
                else:  # the analysis' reason (Unfusable), or its parts' (Unsupported)
                    unfusable[site.fingerprint] = str(site.refusal)
                where[site.fingerprint].append((family, site.method))
    return fused, unfusable, where


def diffusers_proposals() -> tuple[dict, dict, dict]:
    """proposals(), for diffusers' processors: (fingerprint -> Site, -> why unfusable, -> [(file, method)])."""
    from rope_ext.integrations import diffusers as rope_diffusers

    fused, unfusable, where = {}, {}, collections.defaultdict(list)

    def judge(key, unsupported, node, owner, ropes, attrs):
        return unsupported or _qk_norm_rewrite.probe(node, owner, ropes, attrs)

    for name in sorted(rope_diffusers.survey()):
        for site in rope_diffusers._fusion_sites(name, judge):
            if site.fused:
                fused[site.fingerprint] = site.site
            else:
                unfusable[site.fingerprint] = str(site.refusal)
            where[site.fingerprint].append((name, site.method))
    return fused, unfusable, where


def _site(site) -> str:
    args = [] if site.rope == "apply_rotary_pos_emb" else [repr(site.rope)]
    if site.mode != "head":
        args.append(f"mode={site.mode!r}")
    if (site.q_norm, site.k_norm) != ("q_norm", "k_norm"):
        args += [f"q={site.q_norm!r}", f"k={site.k_norm!r}"]
    if site.rotated is not None:
        args.append(f"rotated={site.rotated!r}")
    if site.cast:
        args.append("cast=True")
    if site.owner != "self" or site.pair != (site.mode == "single"):
        return repr(site)
    return f"_self({', '.join(args)})"


class Library(NamedTuple):
    """How the report speaks of one library's entries."""

    name: str
    version: str
    table: _qk_norm_table.Table
    proposals: tuple[dict, dict, dict]  # (fused, unfusable, where), as proposals() returns them
    site: Callable  # Site -> its line in the table
    where: Callable  # [(place, method)] -> the text naming them
    test: Callable  # (place, method) -> the line that starts its test
    indent: str
    # the analysis cannot see an entry's reason (diffusers' norm classes are the attention's): an
    # entry the table lists as unfusable is the table's word, not a difference
    table_wins: bool = False


def transformers_library() -> Library:
    import transformers

    version = transformers.__version__
    return Library(
        "transformers", version, _qk_norm_table.TRANSFORMERS, proposals(), _site,
        lambda where: ", ".join(sorted({f for f, _ in where})),
        lambda family, method: (f'"{family}": Case("{family}", releases=("{version}",)),'
                                "  # tests/test_qk_norm_fusion.py\n"
                                "            (CASES; the model type may be the family's text config's; ATTENTION_CASES"
                                " where the\n            model takes images, audio or an encoder's states)"),
        " " * 8)


def diffusers_library() -> Library:
    import diffusers

    return Library(
        "diffusers", diffusers.__version__, _qk_norm_table.DIFFUSERS, diffusers_proposals(), _processor_site,
        lambda where: ", ".join(sorted({f"{f}:{m.split('.')[0]}" for f, m in where})),
        lambda name, method: (f'"{name}:{method}": Case(<build>, fused_calls=1),'
                              "  # tests/diffusers_processor_cases_*.py"),
        " " * 4, table_wins=True)


def report(lib: Library, entries: bool) -> int:
    """Print the release's entries (``entries``), or its differences from the table; 1 if any."""
    fused, unfusable, where = lib.proposals
    table = lib.table

    def places(key):
        return lib.where(where[key])

    if entries:
        print(f"# {lib.name} {lib.version}: {len(fused)} fusions, {len(unfusable)} unfusable")
        for key, site in sorted(fused.items(), key=lambda kv: where[kv[0]]):
            print(f'{lib.indent}"{key}": {lib.site(site)},  # {places(key)}')
        for key, why in sorted(unfusable.items(), key=lambda kv: where[kv[0]]):
            print(f'{lib.indent}"{key}": {why!r},  # {places(key)}')
        return 0
    changes = 0
    for key, site in sorted(fused.items(), key=lambda kv: where[kv[0]]):
        if table.tested.get(key) == site or (lib.table_wins and key in table.unfusable):
            continue
        changes += 1
        if key in table.tested:
            print(f"CHANGED {key} ({places(key)}): the table says {table.tested[key]}, the rewrite finds {site}")
        else:
            print(f"NEW fusion {key} ({places(key)}, {where[key][0][1]}):\n"
                  f'    table:  "{key}": {lib.site(site)},  # {places(key)}\n'
                  f"    test:   {lib.test(*where[key][0])}")
    for key, why in sorted(unfusable.items(), key=lambda kv: where[kv[0]]):
        if table.unfusable.get(key) != why:
            changes += 1
            print(f'NEW unfusable {key} ({places(key)}): "{key}": {why!r},')
    print(f"{lib.name} {lib.version}: {len(fused)} fusions ({sum(k in table.tested for k in fused)} in the table), "
          f"{len(unfusable)} unfusable; {changes} differences from the table")
    return 1 if changes else 0


def _processor_site(site) -> str:
    args = [repr(site.rope)] + [f"{name}={value!r}" for name, value, default in (
        ("mode", site.mode, "head"), ("q", site.q_norm, "norm_q"), ("k", site.k_norm, "norm_k"),
        ("pair", site.pair, True), ("owner", site.owner, "attn")) if value != default]
    if site.stream is not None:  # the table's name for Flux's text stream, else the Stream itself
        args.append("stream=_TEXT_FIRST" if site.stream == _qk_norm_table._TEXT_FIRST else f"stream={site.stream!r}")
    if site.cast:
        args.append("cast=True")
    if site.sliced is not None:
        args.append(f"sliced={site.sliced!r}")
    if site.k_tables:
        args.append("k_tables=True")
    return f"_attn({', '.join(args)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", action="store_true", help="print every entry, not only the differences")
    parser.add_argument("--library", choices=("transformers", "diffusers"), default="transformers")
    args = parser.parse_args()
    return report(diffusers_library() if args.library == "diffusers" else transformers_library(), args.entries)


if __name__ == "__main__":
    sys.exit(main())
