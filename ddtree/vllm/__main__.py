"""`python -m ddtree.vllm`: materialise the default target and drafter, print shell assignments.

    eval "$(python -m ddtree.vllm)"
    vllm serve "$DDTREE_TARGET" --speculative-config "{\"method\": \"ddtree\", \"model\": \"$DDTREE_DRAFTER\", \"budget\": 64}"
"""
import shlex

from ddtree.vllm.models import default_paths


def main() -> None:
    target, drafter = default_paths()
    print(f"DDTREE_TARGET={shlex.quote(str(target))}")
    print(f"DDTREE_DRAFTER={shlex.quote(str(drafter))}")


if __name__ == "__main__":
    main()
