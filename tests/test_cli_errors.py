"""Bad input to the CLI: exit status 2 and one line naming the value and the fix, never a
traceback, and checked before any model is loaded or anything measured."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from conftest import needs_serve, tiny_model

from specdec import cli
from specdec.cli import main
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.sampling import SamplingParams
from specdec.verification import GreedyRule


def run_cli(capsys, *args: str) -> tuple[int, str]:
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test: the error must come first."""

    def refuse(*args, **kwargs):
        pytest.fail("a model was loaded before the bad value was reported")

    import specdec.api
    import specdec.models.loading

    real = specdec.models.loading.load_model
    monkeypatch.setattr(specdec.models.loading, "load_model", refuse)
    monkeypatch.setattr(specdec.api.SpeculativeDecoder, "from_pretrained", refuse)
    yield
    # a module that imported load_model by name while it was patched (e.g. specdec.bench.runner,
    # first imported by a test here) would keep `refuse` for every later test: put the real one back
    for module in [m for name, m in sys.modules.items() if name.startswith("specdec")]:
        if getattr(module, "load_model", None) is refuse:
            module.load_model = real


def pair_args(pair: Path) -> list[str]:
    return ["--target", str(pair / "target"), "--draft", str(pair / "draft"), "--device", "cpu"]


# ----- prompt files ------------------------------------------------------------------------
def test_prompt_file_not_utf8(capsys, tmp_path, tiny_pair_dir, no_loading):
    path = tmp_path / "latin1.txt"
    path.write_bytes("d\xe9f add(a, b):".encode("latin-1"))
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt-file", str(path))
    assert code == 2 and "is not UTF-8 text" in err and "iconv" in err and str(path) in err


def test_prompt_file_unreadable(capsys, monkeypatch, tmp_path, tiny_pair_dir, no_loading):
    path = tmp_path / "secret.txt"
    path.write_text("x")
    original = Path.read_text

    def read_text(self, *args, **kwargs):  # chmod 000 does not stop root, so refuse the read itself
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt-file", str(path))
    assert code == 2 and "cannot be read (Permission denied)" in err


@pytest.mark.parametrize("content", ["", "\n\n", "\r\n"])
def test_prompt_file_empty(capsys, tmp_path, tiny_pair_dir, no_loading, content):
    path = tmp_path / "empty.txt"
    path.write_text(content)
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt-file", str(path))
    assert code == 2 and f"--prompt-file '{path}' is empty" in err


def test_prompt_file_is_a_directory(capsys, tmp_path, tiny_pair_dir, no_loading):
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt-file", str(tmp_path))
    assert code == 2 and "is a directory" in err and "does not exist" not in err


# ----- values ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [str(2**64), str(2**70)])
def test_seed_beyond_64_bits(capsys, tiny_pair_dir, seed):
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt", "x", "--temperature", "1", "--seed", seed)
    assert code == 2 and f"--seed {seed} does not fit in 64 bits" in err


@pytest.mark.parametrize("seed", ["-1", str(-(2**63) - 1)])
def test_negative_seed(capsys, tiny_pair_dir, no_loading, seed):
    """torch takes -1 as an alias of 2**64 - 1: refused, not silently mapped."""
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt", "x", "--temperature", "1", "--seed", seed)
    assert code == 2 and f"--seed {seed} must be at least 0" in err


def test_negative_seed_in_the_api():
    from specdec.errors import SpecDecError
    from specdec.parsing import check_seed

    check_seed(0)
    with pytest.raises(SpecDecError, match="must be at least 0"):
        check_seed(-1)
    with pytest.raises(SpecDecError, match=r"^seed=-1 must be at least 0"):  # the API's wording, as the server's
        check_seed(-1, "seed=")
    with pytest.raises(SpecDecError, match=r"^seed='1' must be an integer"):
        check_seed("1", "seed=")


@pytest.mark.parametrize("flag", ["--draft", "--target"])
@pytest.mark.parametrize("value", ["", "  "])
def test_empty_model_name(capsys, no_loading, flag, value):
    """An empty name is an error, not the bundled model."""
    code, err = run_cli(capsys, "generate", flag, value, "--prompt", "x")
    assert code == 2 and f"{flag} is empty" in err and f"leave {flag} out" in err


def test_empty_model_name_in_the_api(monkeypatch):
    import specdec.api
    from specdec.api import SpeculativeDecoder
    from specdec.errors import SpecDecError

    monkeypatch.setattr(specdec.api, "load_tokenizer", lambda *a, **k: pytest.fail("loaded a tokenizer"))
    with pytest.raises(SpecDecError, match="draft='' is empty"):
        SpeculativeDecoder.from_pretrained(draft="")
    with pytest.raises(SpecDecError, match="target=' ' is empty"):
        SpeculativeDecoder.from_pretrained(" ", "draft")


# ----- flags that would be ignored --------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "flag", "source"),
    [
        (["--views", "M"], "--views", "tabed"),
        (["--tabed-window", "4"], "--tabed-window", "tabed"),
        (["--draft-source", "lookup", "--tabed-prior", "off"], "--tabed-prior", "tabed"),
        (["--lookup-ngram", "2"], "--lookup-ngram", "lookup"),
        (["--draft-source", "tabed", "--lookup-ngram", "2"], "--lookup-ngram", "lookup"),
    ],
)
def test_draft_source_flag_for_another_source(capsys, tiny_pair_dir, no_loading, args, flag, source):
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt", "x", *args)
    assert code == 2 and f"{flag} applies only to --draft-source {source}" in err


def test_draft_source_flags_defaults():
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--draft-source", "lookup", "--lookup-ngram", "2"])
    cli.apply_draft_source_flags(args)
    assert args.lookup_ngram == 2 and args.views == "M,T" and args.tabed_window == "all" and args.tabed_prior is True
    args = parser.parse_args(["bench", "--out", "unused", "--draft-source", "tabed", "--views", "M,C"])
    cli.apply_draft_source_flags(args)
    assert args.views == "M,C" and args.lookup_ngram == 3 and cli.ensemble_options(args)["policy"] == "grid"


def test_top_k_at_temperature_zero_is_noted(capsys):
    parser = cli.build_parser()
    cli.note_greedy_filters(parser.parse_args(["generate", "--prompt", "x", "--top-k", "5", "--top-p", "0.5"]))
    assert "--top-k 5 and --top-p 0.5 only filter sampling; at --temperature 0 decoding is greedy" in capsys.readouterr().err
    cli.note_greedy_filters(parser.parse_args(["generate", "--prompt", "x", "--top-k", "5"]))
    assert "--top-k 5 only filters sampling; at --temperature 0 decoding is greedy and ignores it" in capsys.readouterr().err
    cli.note_greedy_filters(parser.parse_args(["generate", "--prompt", "x", "--top-k", "5", "--temperature", "1"]))
    cli.note_greedy_filters(parser.parse_args(["generate", "--prompt", "x"]))
    assert capsys.readouterr().err == ""


def test_bad_filter_is_an_error_not_a_note(capsys, tiny_pair_dir, no_loading):
    code, err = run_cli(capsys, "generate", "--prompt", "x", "--top-p", "1.5", *pair_args(tiny_pair_dir))
    assert code != 0 and "top_p=1.5 must be a number in (0, 1]" in err and "note" not in err


def test_method_with_bench_options_names_the_flags(capsys, tiny_pair_dir, no_loading):
    code, err = run_cli(capsys, "generate", "--prompt", "x", "--method", "eagle2:top_k=4", *pair_args(tiny_pair_dir))
    assert code != 0 and "is not known" in err and "their own flags" in err


def test_largest_seed_works(capsys, tiny_pair_dir):
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt", "x", "--temperature", "1", "--seed", str(2**64 - 1), "--max-new-tokens", "4")
    assert code == 0, err


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_temperature_not_finite(capsys, tiny_pair_dir, value):
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt", "x", f"--temperature={value}")
    assert code == 2 and "must be a finite number >= 0" in err


# ----- bench / profile outputs and lists ----------------------------------------------------
def test_bench_out_is_an_existing_file(capsys, tmp_path, tiny_pair_dir, no_loading):
    out = tmp_path / "results.json"
    out.write_text("{}")
    code, err = run_cli(capsys, "bench", *pair_args(tiny_pair_dir), "--methods", "ar,chain", "--no-progress", "--out", str(out))
    assert code == 2 and "is an existing file" in err and out.read_text() == "{}"


def test_bench_empty_methods(capsys, tmp_path, tiny_pair_dir, no_loading):
    code, err = run_cli(capsys, "bench", *pair_args(tiny_pair_dir), "--methods", "", "--out", str(tmp_path / "b"))
    assert code == 2 and "--methods '' names no method" in err
    code, err = run_cli(capsys, "bench", *pair_args(tiny_pair_dir), "--methods", " , ", "--out", str(tmp_path / "b"))
    assert code == 2 and "names no method" in err


@pytest.mark.parametrize("sizes", ["", " , "])
def test_bench_empty_batch_sizes(capsys, tmp_path, tiny_pair_dir, no_loading, sizes):
    """An empty --batch-sizes is an error, not a bench at the default batch size."""
    code, err = run_cli(capsys, "bench", *pair_args(tiny_pair_dir), "--batch-sizes", sizes, "--out", str(tmp_path / "b"))
    assert code == 2 and "--batch-sizes is empty" in err


def test_profile_out_is_a_directory(capsys, monkeypatch, tmp_path, tiny_pair_dir, no_loading):
    code, err = run_cli(capsys, "profile", *pair_args(tiny_pair_dir), "--out", str(tmp_path))
    assert code == 2 and "is a directory" in err and "cost_profile.json" in err


def test_profile_context_beyond_the_models(capsys, monkeypatch, tmp_path, tiny_pair_dir):
    import specdec.cost.profile

    monkeypatch.setattr(specdec.cost.profile, "profile_models", lambda *a, **k: pytest.fail("measured before checking the context"))
    code, err = run_cli(capsys, "profile", *pair_args(tiny_pair_dir), "--context-step", "100000", "--out", str(tmp_path / "p.json"))
    assert code == 2 and "--context-step 100000" in err and "context of 256" in err
    assert "use --context-step 32 or less" in err  # (256 - 128) // 4
    assert not (tmp_path / "p.json").exists()


# ----- serve ------------------------------------------------------------------------------
@needs_serve
def test_serve_port_in_use_before_loading(capsys, tiny_pair_dir, no_loading):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, err = run_cli(capsys, "serve", *pair_args(tiny_pair_dir), "--port", str(port))
    assert code == 2 and f"--port {port} on 127.0.0.1 is not free" in err and "pick another --port" in err


def test_serve_free_port_passes_the_check():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cli.check_port_free("127.0.0.1", port)
    cli.check_port_free("127.0.0.1", 0)


# ----- output locations that cannot be created ----------------------------------------------
def _blocked(tmp_path: Path) -> Path:
    """A path whose parent is a file: no folder or file can be made there."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    return blocker / "out"


@pytest.mark.parametrize("command", [["bench", "--methods", "chain", "--num-prompts", "1", "--repeats", "1"], ["sweep"], ["scenes"]])
def test_out_folder_cannot_be_created(capsys, tmp_path, tiny_pair_dir, no_loading, command):
    out = _blocked(tmp_path)
    extra = [] if command[0] == "scenes" else pair_args(tiny_pair_dir)
    code, err = run_cli(capsys, *command, *extra, "--out", str(out))
    assert code == 2 and f"--out '{out}': cannot create the folder ({out.parent} is a file); give a writable folder" in err


def test_profile_out_file_cannot_be_created(capsys, tmp_path, tiny_pair_dir, no_loading):
    out = _blocked(tmp_path) / "p.json"
    code, err = run_cli(capsys, "profile", *pair_args(tiny_pair_dir), "--out", str(out))
    assert code == 2 and f"--out '{out}': cannot create the file there ({out.parent.parent} is a file)" in err


@pytest.mark.parametrize("command", [["bench", "--methods", "chain"], ["scenes"], ["profile"]])
def test_empty_out_refused(capsys, tmp_path, tiny_pair_dir, no_loading, monkeypatch, command):
    monkeypatch.chdir(tmp_path)  # nothing may land in the current folder
    extra = [] if command[0] == "scenes" else pair_args(tiny_pair_dir)
    code, err = run_cli(capsys, *command, *extra, "--out", "")
    assert code == 2 and "--out is empty" in err and list(tmp_path.iterdir()) == []


def test_out_folder_check_leaves_no_trace(tmp_path, monkeypatch):
    from specdec import paths

    assert paths.folder_write_problem(tmp_path / "new" / "deeper") is None
    assert list(tmp_path.iterdir()) == []  # the folders made to check are gone again

    def refuse(*args, **kwargs):  # root ignores permission bits: refuse the write itself
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(paths.tempfile, "mkstemp", refuse)
    assert paths.folder_write_problem(tmp_path / "new") == f"no file can be written in {tmp_path / 'new'}: Permission denied"
    assert list(tmp_path.iterdir()) == []


# ----- cost profiles ----------------------------------------------------------------------
@pytest.fixture
def no_model_files(monkeypatch):
    """from_pretrained may check its options, but reading a tokenizer or model fails the test."""

    def refuse(*args, **kwargs):
        pytest.fail("a tokenizer or model was loaded before the bad value was reported")

    import specdec.api

    monkeypatch.setattr(specdec.api, "load_tokenizer", refuse)
    monkeypatch.setattr(specdec.api, "load_model", refuse)


def test_cost_profile_is_a_directory(capsys, tmp_path, tiny_pair_dir, no_model_files):
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--method", "cast", "--cost-profile", str(tmp_path), "--prompt", "x")
    assert code == 2 and f"cost profile '{tmp_path}' (--cost-profile) is a directory; give a JSON file path" in err
    assert "does not exist" not in err
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--method", "cast", "--cost-profile", "", "--prompt", "x")
    assert code == 2 and "(--cost-profile) is empty" in err


def test_cost_profile_that_could_not_be_saved(capsys, tmp_path, tiny_pair_dir, no_model_files):
    """A new profile's path must be one a measured profile can be saved to, checked before
    anything is measured (it failed with a bare errno message after measuring); a missing
    folder is fine (saving makes it) and is left as it was."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--method", "cast", "--cost-profile", str(blocker / "p.json"), "--prompt", "x")
    assert code == 2 and "(--cost-profile) does not exist, and a measured one could not be saved there" in err and "is a file" in err, err
    from specdec.cost.table import check_cost_profile_path

    check_cost_profile_path(str(tmp_path / "new" / "folders" / "p.json"))
    assert not (tmp_path / "new").exists()


def test_cost_profile_directory_in_the_api(tmp_path):
    from specdec.cost import CostTable
    with pytest.raises(SpecDecError, match="is a directory; give a JSON file path"):
        make_policy("cast", cost_profile=str(tmp_path))  # from_pretrained builds the policy before loading
    with pytest.raises(SpecDecError, match="is a directory"):
        CostTable.load(tmp_path)


# ----- tree sizes -------------------------------------------------------------------------
@pytest.mark.parametrize(("flag", "value", "named"), [("--expand-top-k", "100000", "top_k=100000"), ("--depth", "100000", "depth=100000")])
def test_eagle2_tree_too_large(capsys, tiny_pair_dir, no_model_files, flag, value, named):
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--method", "eagle2", flag, value, "--prompt", "x")
    assert code == 2 and named in err and "candidate nodes, more than the 16,384" in err and "lower --depth or --expand-top-k" in err


def test_tree_size_limit_keeps_the_used_configurations():
    make_policy("eagle2")
    make_policy("eagle2", depth=13, top_k=16, total_tokens=256)  # well past the largest the tests and benchmarks use
    make_policy("static", depth=8, branching=4, max_nodes=4096)
    with pytest.raises(SpecDecError, match="static max_nodes=100000000: .* lower --max-nodes"):
        make_policy("static", max_nodes=10**8)


@pytest.mark.parametrize(
    ("method", "options", "named"),
    [
        ("chain", {"k": 10**9}, "chain k=1000000000: .* lower --k"),
        ("dynatree", {"b_max": 10**5}, "dynatree b_max=100000, .* lower --b-max, --free-sampled-children, --d-max or --max-nodes"),
        ("dynatree", {"phase": 1, "prune_tau": 0.0, "max_nodes": 10**6, "b_max": 4}, "dynatree b_max=4, .*max_nodes=1000000"),
        ("cast", {"total_tokens": 10**8}, "cast total_tokens=100000000 .* lower --total-tokens"),
    ],
)
def test_other_trees_too_large(method, options, named):
    """Before: a chain with k = 10**9 was killed for memory (24 GB) sizing its buffers, a DynaTree
    with b_max = 10**5 asked for 31 TB, CAST with total_tokens = 10**8 ran at 0.2 tok/s in 9 GB."""
    with pytest.raises(SpecDecError, match=named):
        make_policy(method, **options)


def test_other_tree_limits_keep_the_used_configurations():
    from specdec.methods import make_policy

    for method in ("chain", "dynatree", "cast"):
        make_policy(method)
    make_policy("chain", k=64)
    make_policy("dynatree", b_max=8, d_max=12, max_nodes=256, prune_tau=0.0)  # pruned by rho_stop from depth 1
    make_policy("dynatree", phase=1, b_max=4, d0=6, prune_tau=0.0, max_nodes=512)
    make_policy("dynatree", free_tokens=256, b_max=8)
    make_policy("cast", total_tokens=1024, top_k=64)
    assert make_policy("cast", top_k=10**5, total_tokens=72).children_per_node == 72  # more children than it verifies could never be kept


# ----- sampling numerics ------------------------------------------------------------------
def test_tiny_temperature_is_the_argmax_distribution():
    import torch

    from specdec.sampling import SamplingParams, logits_to_logprobs

    logits = torch.tensor([[1.0, 3.0, 2.0], [5.0, -1.0, 5.0 - 1e-6], [float("-inf"), 0.0, float("-inf")]])
    for t in (1e-300, 1e-30, 1e-45):
        probs = logits_to_logprobs(logits, SamplingParams(temperature=t)).exp()
        assert not probs.isnan().any()
        assert probs.argmax(dim=-1).tolist() == [1, 0, 1] and probs.max(dim=-1).values.min() > 0.49
        assert torch.allclose(probs.sum(dim=-1), torch.ones(3))
    normal = logits_to_logprobs(logits, SamplingParams(temperature=0.7, top_k=2, top_p=0.9))
    assert torch.allclose(normal[0].exp(), torch.softmax(torch.tensor([float("-inf"), 3.0, 2.0]) / 0.7, dim=-1))


def test_tiny_temperature_generates_the_greedy_text(capsys, tiny_pair_dir):
    import json

    outputs = []
    for temperature in ("0", "1e-300"):
        args = ["generate", *pair_args(tiny_pair_dir), "--prompt", "def add", "--temperature", temperature, "--seed", "1", "--max-new-tokens", "8", "--json"]
        assert main(args) == 0
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err
        outputs.append(json.loads(captured.out))
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"]


# ----- train evaluate -----------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"", bytes(range(256)) * 2])
def test_train_evaluate_corpus_without_tokens(capsys, tmp_path, no_loading, content):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(content)
    code, err = run_cli(capsys, "train", "evaluate", "--no-latency", "--corpus", str(corpus))
    assert code == 2 and f"--corpus '{corpus}' yields no tokens to score" in err and "no UTF-8 text" in err


def test_train_evaluate_prompts_need_loops(capsys, tmp_path, no_loading):
    """--prompts is read only with --loops: without it a flag silently ignored, with it a missing
    file reported before the models load."""
    code, err = run_cli(capsys, "train", "evaluate", "--no-latency", "--prompts", str(tmp_path / "p.jsonl"))
    assert code == 2 and "applies only with --loops" in err
    code, err = run_cli(capsys, "train", "evaluate", "--no-latency", "--loops", "--prompts", str(tmp_path / "p.jsonl"))
    assert code == 2 and "no such file" in err


def test_train_evaluate_out_is_a_directory(capsys, tmp_path, no_loading):
    code, err = run_cli(capsys, "train", "evaluate", "--no-latency", "--max-tokens", "64", "--out", str(tmp_path))
    assert code == 2 and f"--out '{tmp_path}' is a directory" in err


# ----- Python API types -------------------------------------------------------------------
@pytest.fixture(scope="module")
def decoder(tiny_pair_dir):
    from specdec.api import SpeculativeDecoder

    return SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": "def", "temperature": 1, "top_k": 1.5}, "top_k=1.5 must be an integer >= 0"),
        ({"prompt": "def", "temperature": 1, "top_p": "0.5"}, "top_p='0.5' must be a number in (0, 1]"),
        ({"prompt": 5}, "prompt must be a string or a list of strings, got int"),
        ({"prompt": b"def"}, "prompt must be a string or a list of strings, got bytes; decode it first"),
        ({"prompt": "def", "stream": 5}, "stream=5 must be a function called with (index, token_ids), or None"),
        ({"prompt": "def", "stream_text": 5}, "stream_text=5 must be a function called with (index, text), or None"),
        ({"prompt": "def", "stop": 5}, "stop=5 must be a string or a list of strings"),
        ({"prompt": "def", "stop": ["a", 3]}, "stop[1]=3: stop strings must be non-empty strings"),
        ({"prompt": "def", "stop": ""}, "stop='': stop strings must be non-empty strings"),
        ({"prompt": "a\ud800b"}, "the prompt holds a lone UTF-16 surrogate '\\ud800' at character 1, which no tokenizer takes"),
    ],
)
def test_api_generate_argument_types(decoder, kwargs, message):
    from specdec.errors import SpecDecError

    with pytest.raises(SpecDecError) as caught:
        decoder.generate(max_new_tokens=4, **kwargs)
    assert message in str(caught.value)


def test_chat_message_with_a_lone_surrogate_is_named():
    from specdec.errors import SpecDecError
    from specdec.text import message_pairs

    with pytest.raises(SpecDecError, match=r"messages\[1\] content holds a lone UTF-16 surrogate '\\udc80' at character 0"):
        message_pairs([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\udc80"}])


@pytest.mark.parametrize("ids", [[10**7], [-1, 5]])
def test_api_token_ids_outside_the_vocabulary(decoder, ids):
    from specdec.errors import SpecDecError
    from specdec.sampling import SamplingParams

    vocab = decoder.target.get_input_embeddings().num_embeddings
    bad = ids[0]
    with pytest.raises(SpecDecError, match=rf"prompt 0: token id {bad} is outside the vocabulary \(0\.\.{vocab - 1}\)"):
        decoder.generate_ids([ids], 4, SamplingParams())


def test_api_model_paths_and_method_types(tiny_pair_dir):
    """A pathlib.Path is a folder like a str; a method that is not a name is named (was a
    TypeError from deep inside)."""
    from specdec.api import SpeculativeDecoder
    from specdec.errors import SpecDecError

    for method in (None, 5):
        with pytest.raises(SpecDecError, match=rf"method={method!r} must be a method's name, one of ar, chain"):
            SpeculativeDecoder.from_pretrained(method=method)
    decoder = SpeculativeDecoder.from_pretrained(tiny_pair_dir / "target", tiny_pair_dir / "draft", method="chain", device="cpu")
    assert decoder.generate("x", max_new_tokens=2).token_ids


def test_json_and_stream_together_are_an_error(capsys, no_loading):
    """--stream was dropped without a word when --json was given too."""
    code, err = run_cli(capsys, "generate", "--prompt", "x", "--json", "--stream")
    assert code == 2 and "give one of them" in err, err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--draft-source", "lookup", "--draft", "/no/such/draft"], "note: --draft '/no/such/draft' is not read: --draft-source lookup drafts without a draft model"),
        (["--method", "ar", "--draft", "/no/such/draft"], "note: --draft '/no/such/draft' is not read: --method ar drafts nothing"),
        (["--method", "ar", "--verify", "mars"], "note: --verify mars changes nothing here"),
    ],
)
def test_flags_nothing_reads_are_noted(capsys, monkeypatch, args, needle):
    """Flags generate does not use here are noted on stderr (they were dropped without a word; a
    mistyped --draft path was never read), and the run goes on."""
    import specdec.cli

    def stop_before_loading(*args, **kwargs):
        raise SystemExit(0)

    monkeypatch.setattr(specdec.cli, "_decoder_for", stop_before_loading)
    code, err = run_cli(capsys, "generate", "--prompt", "x", *args)
    assert code == 0 and needle in err, err


# ----- booleans are not sizes ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "option"),
    [("chain", "k"), ("static", "depth"), ("eagle2", "depth"), ("eagle2", "top_k"), ("cast", "depth"), ("dynatree", "d_max")],
)
def test_a_boolean_is_not_a_tree_size(method, option):
    """True is an int to Python (so `depth=True` once built a depth-1 tree); every size option refuses it by name."""
    with pytest.raises(SpecDecError, match=f"{option}=True must be a positive integer"):
        make_policy(method, **{option: True})


def test_a_boolean_is_not_a_token_count_or_batch_size():
    engine = SpeculativeEngine(tiny_model("llama", seed=0), make_policy("ar"), GreedyRule(), None)
    with pytest.raises(SpecDecError, match="max_new_tokens=True"):
        engine.generate([[1, 2]], True)
    with pytest.raises(SpecDecError, match="batch_size=True"):
        engine.generate([[1, 2]], 4, batch_size=True)


def test_decoder_arguments_in_another_order_are_named(tiny_pair_dir):
    """SpeculativeDecoder(target, tokenizer, draft): models given in from_pretrained's order
    (target, draft, tokenizer) are named, not an AttributeError from deep inside."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.api import SpeculativeDecoder

    target = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "target")
    draft = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "draft")
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair_dir / "target")
    with pytest.raises(SpecDecError, match="tokenizer is a model, not a tokenizer; draft is a tokenizer, not a transformers model; pass them in this order"):
        SpeculativeDecoder(target, draft, tokenizer)
    with pytest.raises(SpecDecError, match="target is a str, not a transformers model"):
        SpeculativeDecoder(str(tiny_pair_dir / "target"), tokenizer)
    assert SpeculativeDecoder(target, tokenizer, draft).generate("def f(x):", max_new_tokens=2).token_ids  # the right order decodes


def test_token_id_prompts_of_the_wrong_shape_are_named(tiny_pair_dir):
    """generate_ids takes a list of token-id lists: a tensor (maybe padded) or one flat list is
    named with the fix, not a tensor truth-value or len() error; generate() given ids points to
    generate_ids; params=None is greedy."""
    import torch

    from specdec.api import SpeculativeDecoder

    dec = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), device="cpu")
    with pytest.raises(SpecDecError, match=r"prompts is a tensor \[1, 3\]; pass a list of token-id lists"):
        dec.generate_ids(torch.tensor([[5, 6, 7]]), 3)
    with pytest.raises(SpecDecError, match=r"prompts is a list of 3 integers; .*\[ids\] for one prompt"):
        dec.generate_ids([5, 6, 7], 3)
    with pytest.raises(SpecDecError, match=r"got int \(for token ids use generate_ids\)"):
        dec.generate([5, 6, 7], max_new_tokens=3)
    with pytest.raises(SpecDecError, match="params must be a specdec.sampling.SamplingParams, got float"):
        dec.generate_ids([[5, 6, 7]], 3, 0.5)
    assert dec.generate_ids([[5, 6, 7]], 3)[0].token_ids == dec.generate_ids([[5, 6, 7]], 3, SamplingParams())[0].token_ids


def test_a_pad_token_the_target_cannot_embed_is_not_used(tiny_pair_dir):
    """A pad token added to the tokenizer without resizing the model's embedding: padding is
    masked out, so the decoder pads with EOS instead (the engine refuses ids it cannot embed),
    and a batch of prompts of different lengths decodes as each prompt alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.api import SpeculativeDecoder

    target = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "target")
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair_dir / "target")
    tokenizer.add_special_tokens({"pad_token": "<|added_pad|>"})
    assert tokenizer.pad_token_id >= target.get_input_embeddings().weight.shape[0]
    dec = SpeculativeDecoder(target, tokenizer, method="ar")
    assert dec.pad_token_id in dec.eos_token_ids
    texts = ["def f(x):", "import os\nimport sys\nclass A:"]
    together = [r.token_ids for r in dec.generate(texts, max_new_tokens=4)]
    assert together == [dec.generate(t, max_new_tokens=4).token_ids for t in texts]
    with pytest.raises(SpecDecError, match=r"pad_token_id=\d+ must be a token id in 0\.\."):
        SpeculativeEngine(target, make_policy("ar"), GreedyRule(), None, pad_token_id=tokenizer.pad_token_id)
