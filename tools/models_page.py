#!/usr/bin/env python3
"""Generate docs/models.md, the supported-models page, from the integrations' own listings.

    python3 tools/models_page.py            # write docs/models.md (about 80 s on 2 CPUs)
    python3 tools/models_page.py --check    # exit 1, with a diff, where docs/models.md is not what it would write

One invocation regenerates the whole page. Its tables come from the structured reports that
``python -m rope_ext.integrations.transformers`` (``.diffusers``, ``.timm``) print: transformers'
``survey()`` (each family checked against ``installed_report()``, which imports its modeling
modules as the listing does: a difference stops the script), diffusers' ``survey()`` and timm's
``survey()``. The per-model tables are for the suite's releases (``SUITE``): transformers 5.23.0 and
diffusers 0.42.1, installed beside ``python3`` by ``make setup``, and timm 1.0.31, from cuda-check's
venv (``build/venv-cuda``, the Python here that has timm and the torchvision it needs). The count
table covers every tested release (``RELEASES``); each library and release is listed by this script
in a subprocess (``--part``), with the release's folder first on ``sys.path`` and this checkout's
rope_ext after it:

    build/releases/<library>-<version>/site    made by `make releases-check` (tools/releases_check.sh)
    build/cuda-check/timm-1.0.30               made by `make cuda-check` (tools/cuda_check.sh)

``--site NAME=FOLDER`` (``NAME`` as ``transformers-4.57.6``) and ``--timm-python`` point elsewhere.
Each subprocess checks that it lists the release it was given.

tests/test_models_page.py checks the transformers and diffusers sections against the installed
releases (``section()``, in the test's own process).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "models.md"
COMMAND = "python3 tools/models_page.py"

# The suite's releases (pyproject.toml's test extra pins transformers and diffusers; tools/cuda_check.sh
# installs timm): the detailed tables are theirs.
SUITE = {"transformers": "5.23.0", "diffusers": "0.42.1", "timm": "1.0.31"}

# Every tested release: (library, version, the folder put first on sys.path, or None for the one
# installed beside the Python that lists the library).
RELEASES = [
    ("transformers", "4.57.6", "build/releases/transformers-4.57.6/site"),
    ("transformers", "5.23.0", None),
    ("transformers", "5.24.0", "build/releases/transformers-5.24.0/site"),
    ("diffusers", "0.41.0", "build/releases/diffusers-0.41.0/site"),
    ("diffusers", "0.42.1", None),
    ("timm", "1.0.30", "build/cuda-check/timm-1.0.30"),
    ("timm", "1.0.31", None),
]
TIMM_PYTHON = "build/venv-cuda/bin/python"

INTRO = """\
# Supported models

Which models' RoPE rope_ext runs, per library and release, as `patch()` of
[rope_ext.integrations](integrations.md) decides it from each library's installed source code.

- **Switched**: the model's RoPE runs on rope_ext's op. rope_ext switches a model only where its RoPE
  code matches a form rope_ext is tested on; otherwise the model keeps the library's own code, and
  the table gives the reason.
- **Fused**: the attention's q and k RMS norms and its RoPE run as one `rope_ext.qk_norm_rotary`
  call (`patch(qk_norm=False)` leaves them apart). A model with RoPE but no such norms says *none*.
  Where an attention is not fused, its norms and RoPE still run, as two steps, and the table gives
  the reason.

A **RoPE form** is what a model's RoPE function computes, in rope_ext's terms: its name, then how
the function is called, the pairing of columns (half-split or interleaved) and, where they apply,
the tables it takes, the columns it rotates and the dtype it computes in.
"""

POLICY = """\
## Version policy

**A release not listed here.** Nothing is decided by version number. When you call `patch()`,
rope_ext reads the installed library's source: code that did not change since a tested release
matches its tested form and is switched. Code that changed and matches no tested form is never
switched on a guess: it keeps the library's own code, and `patch()` names it, with the reason, in a
warning (`rope_ext.integrations._engine.RefusedWarning`), once per process. For transformers that
is the whole model family, named when its model code is imported (or at the `patch()` call, where it
is imported already); for diffusers the model file; for timm the function or method. An attention
whose QK-norm fusion cannot be installed is named the same way and keeps its norms as they are; its
RoPE is switched all the same. Everything else is switched as usual.
`patch(strict=True)` raises a `ValueError` instead, before anything is switched; so does naming a
refused model, as in `patch(["llama"])`.

**Checking the version you have installed.** These commands list, for the installed release, each
model family or file with RoPE, its form, whether `patch()` switches it or why not, and each
attention's QK-norm, fused or why not (the transformers one imports every model: seconds):

```sh
python -m rope_ext.integrations.transformers
python -m rope_ext.integrations.diffusers
python -m rope_ext.integrations.timm
```
"""

# --- the listing of one library, in the process that has it ------------------------------------------


def _md(text: str) -> str:
    """Text for a table cell: Markdown's special characters escaped (in code spans only ``|``, which
    ends a cell even there); ``_`` only where it could start or end emphasis (not inside a word)."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unmatched backtick: no code spans
        parts = [text.replace("`", "\\`")]
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(part.replace("|", "\\|"))
        else:
            part = re.sub(r"([\\*|<>\[\]])", r"\\\1", part)
            out.append(re.sub(r"(?<!\w)_|_(?!\w)", r"\\_", part))
    return "`".join(out)


def _form(form) -> str:
    """A form as the listings name it."""
    return f"'{form.name}' form ({form.describe()})"


def _forms(functions) -> list[str]:
    """The distinct forms of a report's functions, in order (the refused ones have none)."""
    return list(dict.fromkeys(_form(f.form) for f in functions if f.form is not None))


def _qk_norms(sites) -> str:
    if not sites:
        return "none"
    return "<br>".join(f"`{s.method}`: fused" if s.fused else f"`{s.method}`: not fused: {_md(s.reason)}"
                       for s in sites)


def _switched(report) -> str:
    return "yes" if report.patchable else f"no: {_md(report.reason)}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _installed_version(library: str) -> str:
    return importlib.import_module(library).__version__


def transformers_reports(install_checks: bool = False) -> dict:
    """transformers' ``survey()``; with ``install_checks``, each family's report compared with
    ``installed_report()`` (what the listing prints: its modeling modules imported, each switch
    checked as installing it checks), and a difference a SystemExit naming the families."""
    from rope_ext.integrations import transformers as rope_hf

    reports = rope_hf.survey()
    if install_checks:
        differ = {f: rope_hf.installed_report(f) for f in reports}
        differ = {f: r for f, r in differ.items() if r != reports[f]}
        if differ:
            raise SystemExit(f"transformers {_installed_version('transformers')}: installing differs from the "
                             f"source classification for {sorted(differ)}: {differ}")
    return reports


def transformers_counts(reports: dict) -> dict:
    with_norms = [r for r in reports.values() if r.qk_norms]
    return {"total": len(reports), "switched": sum(r.patchable for r in reports.values()),
            "with_qk_norm": len(with_norms), "fused": sum(any(s.fused for s in r.qk_norms) for r in with_norms),
            "fused_all": sum(bool(r.qk_norm_fused) for r in with_norms)}


def transformers_table(reports: dict) -> str:
    rows = [[family, "<br>".join(_md(f) for f in _forms(r.functions)) or "—", _switched(r), _qk_norms(r.qk_norms)]
            for family, r in reports.items()]
    return _table(["Family", "RoPE form", "Switched", "QK-norm"], rows)


def diffusers_counts(reports: dict) -> dict:
    with_norms = [r for r in reports.values() if r.qk_norms]
    return {"total": len(reports), "switched": sum(r.patchable for r in reports.values()),
            "with_qk_norm": len(with_norms), "fused": sum(any(s.fused for s in r.qk_norms) for r in with_norms)}


def diffusers_table(reports: dict) -> str:
    rows = []
    for name, r in reports.items():
        forms = [_md(f) for f in _forms(r.functions)]
        forms += [f"through {', '.join(f'`{n}`' for n in r.reaches)}"] if r.reaches else []
        # a file without QK-norms of its own points at those of the files it reaches that have some
        see = [f"`{n}`" for n in r.reaches if reports.get(n) is not None and reports[n].qk_norms]
        qk_norms = _qk_norms(r.qk_norms) if r.qk_norms or not see else f"see {', '.join(see)}"
        rows.append([name, "<br>".join(forms) or "—", _switched(r), qk_norms])
    return _table(["Model file", "RoPE form", "Switched", "QK-norm"], rows)


def timm_counts(codes: dict) -> dict:
    return {"total": len(codes), "switched": sum(c.form is not None for c in codes.values())}


def timm_table(codes: dict) -> str:
    from rope_ext.integrations import timm as rope_timm

    rows = []
    for code in codes.values():
        where = ", ".join(f"`{m}`" for m in rope_timm._bound_in(code)) if code.form and not code.is_method else "—"
        rows.append([f"`{code.module}.{code.qualname}`", _md(rope_timm._describe(code.form)) if code.form else "—",
                     "yes" if code.form else f"no: {_md(code.reason)}", where])
    return _table(["Function or method", "RoPE form", "Switched", "Replaced in"], rows)


def switched_text(library: str, counts: dict) -> str:
    what = {"transformers": "families", "diffusers": "model files", "timm": "functions and methods"}[library]
    return f"{counts['switched']} of {counts['total']} {what}"


def fused_text(library: str, counts: dict) -> str:
    if library == "transformers":
        return (f"{counts['fused']} of {counts['with_qk_norm']} families with QK-norm "
                f"({counts['fused_all']} in every attention)")
    if library == "diffusers":
        return f"{counts['fused']} of {counts['with_qk_norm']} model files with QK-norm (in at least one processor)"
    return "—"


SECTION_INTROS = {
    "transformers": (
        "One row per model family: the folder under `transformers/models/`, which is the `config.model_type` of "
        "most models and the name `patch([...])` takes. The QK-norm column has one line per attention that "
        "normalizes q and k and applies RoPE (`Class.method`)."),
    "diffusers": (
        "One row per model file with RoPE: the file's name under `diffusers/models/transformers/` or "
        "`controlnets/` without `transformer_`, and diffusers' shared `embeddings` and `attention_processor`: the "
        "name `patch([...])` takes. A file whose attention processors live in another file reaches RoPE "
        "*through* it, and is switched with it. The QK-norm column has one line per attention processor that "
        "normalizes q and k and applies RoPE; a file without such processors of its own points at the files it "
        "reaches that have some."),
    "timm": (
        "timm's RoPE functions, replaced in each timm module that holds them (so every model that calls them: "
        "EVA-02, DINOv3, the RoPE ViTs, ...), and the attention methods whose rotation skips the prefix tokens, "
        "rewritten to rotate q and k in one call."),
}


def _listing(library: str, install_checks: bool = False) -> tuple[str, dict]:
    """The installed library's table and counts."""
    if library == "transformers":
        reports = transformers_reports(install_checks)
        return transformers_table(reports), transformers_counts(reports)
    if library == "diffusers":
        from rope_ext.integrations import diffusers as rope_diffusers

        reports = rope_diffusers.survey()
        return diffusers_table(reports), diffusers_counts(reports)
    from rope_ext.integrations import timm as rope_timm

    codes = rope_timm.survey()
    return timm_table(codes), timm_counts(codes)


def render_section(library: str, version: str, table: str, counts: dict) -> str:
    summary = f"Switched: {switched_text(library, counts)}."
    if library != "timm":
        summary += f" QK-norm fused: {fused_text(library, counts)}."
    return f"## {library} {version}\n\n{summary} {SECTION_INTROS[library]}\n\n{table}"


def section(library: str, install_checks: bool = False) -> tuple[str, str, dict]:
    """(version, the page's section, counts) for the library installed in this process."""
    version = _installed_version(library)
    table, counts = _listing(library, install_checks)
    return version, render_section(library, version, table, counts), counts


def summary_row(library: str, version: str, counts: dict) -> str:
    return f"| {library} | {version} | {switched_text(library, counts)} | {fused_text(library, counts)} |"


def render_page(sections: dict[str, str], counts: dict[tuple[str, str], dict]) -> str:
    rows = [summary_row(lib, version, counts[lib, version]) for lib, version, _ in RELEASES]
    summary = ("## Tested releases\n\nWhat `patch()` switches on each tested release (the tables below are for "
               f"{', '.join(f'{lib} {v}' for lib, v in SUITE.items())}):\n\n"
               "| Library | Release | Switched | QK-norm fused |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    header = (f"<!-- generated by `{COMMAND}` from the integrations' listings: do not edit "
              "(it needs the release folders and the timm venv its docstring names) -->\n")
    return "\n".join([header + INTRO, summary, *(sections[lib] for lib in SUITE), POLICY])


# --- the whole page: each release in a subprocess -------------------------------------------------------


def _run_part(library: str, version: str, folder: str | None, python: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, str(ROOT), os.environ.get("PYTHONPATH")) if p)
    if folder is not None and not Path(folder).is_dir():
        raise SystemExit(f"models_page: no {library} {version} at {folder} (see {COMMAND} --help)")
    proc = subprocess.run([python, str(Path(__file__).resolve()), "--part", library], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"models_page: listing {library} {version} failed:\n"
                         f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    part = json.loads(proc.stdout.strip().splitlines()[-1])
    if part["version"] != version:
        raise SystemExit(f"models_page: expected {library} {version}, found {part['version']} "
                         f"({python}, {folder or 'its own install'})")
    return part


def build_page(sites: dict[str, str], timm_python: str) -> str:
    def job(entry):
        library, version, folder = entry
        folder = sites.get(f"{library}-{version}", folder)
        folder = None if folder is None else str((ROOT / folder).resolve())
        python = timm_python if library == "timm" else sys.executable
        return entry, _run_part(library, version, folder, python)

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        parts = dict(pool.map(job, RELEASES))
    counts = {(lib, v): part["counts"] for (lib, v, _), part in parts.items()}
    sections = {lib: part["section"] for (lib, v, _), part in parts.items() if SUITE[lib] == v}
    return render_page(sections, counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with docs/models.md instead of writing it")
    parser.add_argument("--site", action="append", default=[], metavar="NAME=FOLDER",
                        help="the folder of a release (NAME: e.g. transformers-4.57.6)")
    parser.add_argument("--timm-python", default=str(ROOT / TIMM_PYTHON), help="a Python with timm")
    parser.add_argument("--part", choices=sorted(SUITE), help=argparse.SUPPRESS)  # one listing, as JSON
    args = parser.parse_args()
    if args.part:
        version, text, counts = section(args.part, install_checks=True)
        print(json.dumps({"version": version, "section": text, "counts": counts}))
        return
    sites = dict(s.split("=", 1) for s in args.site)
    unknown = set(sites) - {f"{lib}-{v}" for lib, v, _ in RELEASES}
    if unknown:
        parser.error(f"no tested release named {sorted(unknown)}")
    page = build_page(sites, args.timm_python)
    if args.check:
        old = PAGE.read_text() if PAGE.exists() else ""
        if old != page:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), page.splitlines(True),
                                                       "docs/models.md", "regenerated"))
            raise SystemExit(f"docs/models.md is stale: run `{COMMAND}`")
        print("docs/models.md is up to date")
        return
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
