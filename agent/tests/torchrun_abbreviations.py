"""How torchrun's own parser reads abbreviated long flags, for cli_torchrun_abbreviations.rs.

Reads words (`--max`, `--no-p`, ...) one per line on stdin and prints one JSON object:
  flags:   [{"dest": ..., "names": [long option strings]}], in the parser's order
  answers: [{"word": ..., "dest": D}]            the word is that flag
           [{"word": ..., "ambiguous": [names]}] argparse refuses it, naming these
           [{"word": ..., "unknown": true}]      no torchrun flag starts with it
Each word is parsed by torchrun's real parser (torch.distributed.run.get_args_parser)
through parse_known_args, so whatever this Python's argparse does is what gets recorded.
"""

import json
import re
import sys

import torch
import torch.distributed.run as run

# A value no default equals, so the flag it lands in is the one that changed.
PROBE = "probe-value-7f3a"
SCRIPT_DESTS = {"training_script", "training_script_args"}
AMBIGUOUS = re.compile(r"ambiguous option: (\S+) could match (.+)")
# A flag that took the word but not PROBE (an int, a choice): argparse names the flag.
BAD_VALUE = re.compile(r"argument ([^:]+): .*")


class Refused(Exception):
    pass


class HelpShown(Exception):
    pass


def parser():
    p = run.get_args_parser()

    def error(message):
        raise Refused(message)

    def help_shown(*_args, **_kwargs):
        raise HelpShown()

    p.error = error
    p.print_help = help_shown
    return p


def answer(p, baseline, word):
    try:
        # A flag that takes a value gets PROBE; one that takes none leaves PROBE as the
        # script and x.py as its argument.
        ns, extra = p.parse_known_args([word, PROBE, "x.py"])
    except HelpShown:
        return {"word": word, "dest": "help"}
    except Refused as e:
        if m := AMBIGUOUS.fullmatch(str(e)):
            return {"word": word, "ambiguous": m.group(2).split(", ")}
        if m := BAD_VALUE.fullmatch(str(e)):
            names = m.group(1).split("/")
            action = next(a for a in p._actions if names[0] in a.option_strings)
            return {"word": word, "dest": action.dest}
        raise
    changed = [
        k
        for k, v in vars(ns).items()
        if k not in SCRIPT_DESTS and v != baseline[k]
    ]
    if not changed:
        if word not in extra:
            raise SystemExit(f"{word}: no flag changed and not left over: {ns} {extra}")
        return {"word": word, "unknown": True}
    if len(changed) != 1:
        raise SystemExit(f"{word}: several flags changed: {changed}")
    return {"word": word, "dest": changed[0]}


def main():
    p = parser()
    baseline = vars(p.parse_known_args(["x.py"])[0])
    flags = [
        {"dest": a.dest, "names": [s for s in a.option_strings if s.startswith("--")]}
        for a in p._actions
        if any(s.startswith("--") for s in a.option_strings)
    ]
    words = [w for w in sys.stdin.read().split("\n") if w]
    json.dump(
        {
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "allow_abbrev": p.allow_abbrev,
            "flags": flags,
            "answers": [answer(parser(), baseline, w) for w in words],
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
