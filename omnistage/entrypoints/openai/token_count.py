"""The token counter's child process (prep_pool.TokenCounter): a pickled tokenizer, then
texts, each answered with its token count (-1 when it does not tokenize), framed as
8-byte little-endian lengths on stdin and stdout. It ends when its stdin closes."""

from __future__ import annotations

import pickle
import sys

from omnistage.entrypoints.openai.prep_pool import read_frame, write_frame


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    try:
        tokenizer = pickle.loads(read_frame(stdin))
        while True:
            text = read_frame(stdin).decode("utf-8", "surrogatepass")
            try:
                count = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            except Exception:  # the tokenizer's own errors (lone surrogates, ...): no count
                count = -1
            write_frame(stdout, count.to_bytes(8, "little", signed=True))
    except EOFError:
        return


if __name__ == "__main__":
    main()
