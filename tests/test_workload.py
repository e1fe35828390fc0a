"""A job's workload counted before it loads (ggpipe.service.workload): the
prompt tokens as the engine tokenizes them, with a vocabulary-only load,
and None for what cannot be read (the job reports it once loaded)."""

from ggpipe.runtime.vocab import vocab_only
from ggpipe.service.chat_prompt import chat_tokens
from ggpipe.service.workload import workload


def test_plain_and_chat_prompts_are_counted_as_the_engine_tokenizes_them(smollm2):
    chat = [{"role": "user", "content": "What is MPI?"}]
    with vocab_only(smollm2) as vocab:
        n_plain = int(vocab.tokenize("Once upon a time").shape[0])
        n_chat = int(chat_tokens(vocab, chat).shape[0])
    got = workload(str(smollm2), lambda: [("Once upon a time", None, 4), (None, chat, 8)], 2048)
    assert got == (n_plain + n_chat, 12) and n_chat > n_plain


def test_what_cannot_be_read_or_run_is_unknown(tmp_path, smollm2):
    assert workload(str(tmp_path / "missing.gguf"), lambda: [("hi", None, 4)], 2048) is None

    def unreadable():
        raise OSError("gone")
    assert workload(str(smollm2), unreadable, 2048) is None
    assert workload(str(smollm2), lambda: [(None, [{"role": "nobody", "content": 5}], 4)], 2048) is None
    # a request the job will refuse (it does not fit its cells): no choice is made for it
    long = "word " * 300
    assert workload(str(smollm2), lambda: [(long, None, 4)], 2048) is not None
    assert workload(str(smollm2), lambda: [(long, None, 4)], 64) is None
