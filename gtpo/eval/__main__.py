"""``python -m gtpo.eval``: offline evaluation of generation dumps (see ``gtpo.eval.cli``)."""

from gtpo.eval.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
