"""The docs show one way to launch a job, ``neocomm run``.

Commands in code blocks of README.md and docs/*.md that start an MPI
launcher (``mpirun``, ``mpiexec``, ``srun``) are allowed only in the one
section that explains running without ``neocomm run``.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: (file, heading) of the only section that may show the launchers themselves
ALLOWED = {("docs/runtime.md", "Plain mpirun or srun on a cluster")}

_LAUNCHER = re.compile(
    r"(?:^|[;&|(]\s*|\b(?:do|then|else|time|exec|env|nohup)\s+)"   # a command's position
    r"(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*"                           # VAR=value prefixes
    r"(mpirun|mpiexec|srun)(?=\s|$)")


def launcher_lines(text: str):
    """``(line number, heading, line)`` of each code line that starts an MPI launcher.

    Code is a fenced block (```` ``` ```` or ``~~~``) or an indented one (four
    spaces after a blank line); ``$ `` prompts are dropped, comments skipped.
    """
    heading, fence, in_indented, prev_blank = "", None, False, True
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence:
            if stripped.startswith(fence):
                fence = None
                continue
            code = True
        elif stripped.startswith(("```", "~~~")):
            fence, in_indented = stripped[:3], False
            continue
        else:
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            indented = line.startswith(("    ", "\t")) and bool(stripped)
            in_indented = indented and (prev_blank or in_indented)
            code = in_indented
        prev_blank = not stripped
        if not code or stripped.startswith("#"):
            continue
        command = stripped[2:] if stripped.startswith("$ ") else stripped
        if _LAUNCHER.search(command):
            yield number, heading, line


def test_the_scanner_finds_launchers_in_code_only():
    text = "\n".join([
        "# T", "Run it under `mpirun` (prose is fine).", "mpirun in prose too.", "",
        "```", "$ mpirun -n 2 x", "NEOCOMM_RANKS_PER_NODE=2 mpirun -n 4 \\", "  y",
        "for n in 2 4; do mpirun -n $n z; done", "# mpirun in a comment", "srun -N 2 a",
        "neocomm run -n 2 -- b", 'subprocess.run(["mpirun", "-n", "2"])', "```", "",
        "## U", "", "    mpiexec -n 2 c", "", "- a list", "    mpirun continued prose",
    ])
    found = [(n, h) for n, h, _ in launcher_lines(text)]
    assert found == [(6, "T"), (7, "T"), (9, "T"), (11, "T"), (18, "U")]


def test_docs_launch_with_neocomm_run():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad, allowed_seen = [], set()
    for path in files:
        name = path.relative_to(ROOT).as_posix()
        for number, heading, line in launcher_lines(path.read_text(encoding="utf-8")):
            if (name, heading) in ALLOWED:
                allowed_seen.add((name, heading))
            else:
                bad.append(f"{name}:{number}: {line.strip()}")
    assert not bad, ("launch with `neocomm run` (plain mpirun/srun belong in the section "
                     f"{sorted(ALLOWED)}):\n" + "\n".join(bad))
    assert allowed_seen == ALLOWED, "the section on plain mpirun and srun is gone or renamed"
