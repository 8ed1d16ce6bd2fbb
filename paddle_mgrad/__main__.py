"""``python -m paddle_mgrad <command>`` and the ``paddle-mgrad`` script.

Commands: ``doctor`` (:mod:`paddle_mgrad.diagnostics.doctor`: what runs where, why, whether it works).
The package's ``__init__`` imports nothing of Paddle for this process (:mod:`paddle_mgrad._cli`).
"""

import sys

USAGE = """usage: python -m paddle_mgrad doctor [--json] [--timeout SECONDS]
       paddle-mgrad doctor [--json] [--timeout SECONDS]

doctor   what paddle_mgrad runs where, why, and whether it works (exit 0 healthy, 1 problems)"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "doctor":
        from .diagnostics.doctor import main as doctor

        return doctor(argv[1:])
    print(f"paddle_mgrad: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
