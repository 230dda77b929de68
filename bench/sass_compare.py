"""Compare the SASS of kernel sources between a git revision and the working tree, function by function.

Every `// lumo:test-defines` build of each named source in lumo/kernels is compiled (NVRTC, no GPU) for
sm_90 and sm_121a in both trees, each with its own headers, and disassembled with cuobjdump (the
nvidia-cuda-cuobjdump wheel's, or give --cuobjdump); prints the functions whose instructions differ.
A refactor that claims "the same code" should print none.

    python bench/sass_compare.py HEAD~1 linear.cu gdn.cu --cuobjdump /path/to/cuobjdump
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).parents[1]


def sass(kernel_dir: Path, names: list[str], cuobjdump: str) -> dict[tuple[str, str, str, str], list[str]]:
    """{(source, defines, arch, function): instructions} of every test-defines build in `kernel_dir`."""
    from lumo.kernels import compile as nvrtc

    nvrtc.KERNEL_DIR = kernel_dir  # this tree's headers (include path), not the installed package's
    getattr(nvrtc.include_dirs, "cache_clear", lambda: None)()
    out = {}
    # cuobjdump runs nvdisasm from PATH: the wheel ships it beside cuobjdump
    env = os.environ | {"PATH": f"{Path(shutil.which(cuobjdump) or cuobjdump).parent}:{os.environ['PATH']}"}
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        for name in names:
            src = (kernel_dir / name).read_text()
            for line in re.findall(r"// lumo:test-defines(.*)", src) or [""]:
                defines = dict(kv.split("=") for kv in line.split())
                for arch in ("sm_90", "sm_121a"):
                    cubin.write_bytes(nvrtc.compile_to_cubin(src, arch, nvrtc.define_options(defines), name))
                    text = subprocess.run(
                        [cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env
                    ).stdout
                    fn = None
                    for row in text.splitlines():
                        if m := re.search(r"Function : (\S+)", row):
                            fn = (name, line.strip(), arch, m.group(1))
                            out[fn] = []
                        elif fn and re.search(r"/\*[0-9a-f]{4,}\*/", row):  # every offset, not just /*0...*/
                            out[fn].append(re.sub(r"/\* 0x[0-9a-f]+ \*/", "", row).split(";")[0].strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="git revision to compare the working tree against")
    ap.add_argument("sources", nargs="+", help="kernel sources in lumo/kernels, e.g. linear.cu")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["git", "worktree", "add", "--detach", "-f", tmp, args.rev], cwd=ROOT, check=True,
                       capture_output=True)  # fmt: skip
        try:
            before = sass(Path(tmp) / "lumo" / "kernels", args.sources, args.cuobjdump)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tmp], cwd=ROOT, capture_output=True)
    after = sass(ROOT / "lumo" / "kernels", args.sources, args.cuobjdump)
    if not before or not after:
        raise SystemExit("no SASS was read: check that cuobjdump (and nvdisasm beside it) runs")
    common = [k for k in before if k in after]
    differ = [k for k in common if before[k] != after[k]]
    for k in differ:
        print("differs:", *k)
    for k in sorted(set(before) ^ set(after)):
        print("only in", "rev" if k in before else "tree", *k)
    print(f"{len(common) - len(differ)} of {len(common)} common functions identical")


if __name__ == "__main__":
    main()
