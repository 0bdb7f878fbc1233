"""Output for the test workers: one write per line.

The workers share the launcher's stdout (as under torchrun), and print() writes the text
and its newline separately, so two ranks starting together could put their lines on one.
"""
import sys


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
