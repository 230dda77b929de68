"""`python -m lumo.kernels clean-cache | compile-all [ARCH ...]`."""

from __future__ import annotations

import argparse

from .compile import (
    cache_dir,
    cached_cubin,
    clean_cache,
    compile_test_defines,
    define_options,
    kernel_sources,
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lumo.kernels")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser(
        "clean-cache", help="delete cached cubins ($LUMO_CACHE_DIR, default ~/.cache/lumo/kernels)"
    )
    warm = sub.add_parser("compile-all", help="compile every kernel's test specialisations into the cache")
    warm.add_argument("arch", nargs="*", default=["sm_90", "sm_121a"])
    args = ap.parse_args(argv)
    if args.cmd == "clean-cache":
        print(f"removed {clean_cache()} cubins from {cache_dir()}")
        return
    for path in kernel_sources():
        for defines in compile_test_defines(path):
            for arch in args.arch:
                cached_cubin(path.read_text(), arch, define_options(defines), path.name)
                print(f"{path.name} {arch} {defines}")


if __name__ == "__main__":
    main()
