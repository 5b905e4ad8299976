"""ExecuTorch's llama_main beside zl (issue 55 item 2): what it prints is read back exactly (`parse_output`,
`printed_text`), a failing run is one line, `zl deploy --program` pushes the build that fits each device and says how
to run it.

With tools/build_llm_runner.sh's builds present (build-llm/, ignored; a fresh clone has none, and these skip), the
host llama_main's greedy continuations on a tiny-random program of `zl export-model` equal the Python runtime's
(`zl generate --program`'s), and the static aarch64 one's do under `qemu-aarch64` with an empty environment and no
sysroot (slow)."""

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from zl_base.errors import ZLError

ROOT = Path(__file__).resolve().parent.parent
OBSERVED = {"prompt_tokens": 5, "generated_tokens": 4, "model_load_start_ms": 1000, "model_load_end_ms": 1250,
            "inference_start_ms": 2000, "prompt_eval_end_ms": 2100, "inference_end_ms": 2400, "first_token_ms": 2100}


def observer_line(**changes) -> bytes:
    return b"PyTorchObserver " + json.dumps({**OBSERVED, **changes}).encode() + b"\n"


def test_parse_output_reads_the_continuation_and_the_statistics():
    from zl_device.results.llm_runner import parse_output

    out = parse_output(b"Hello there, friend\n" + observer_line(), "Hello", 1234, 2.5, ["llama_main"])
    assert out.text == b" there, friend"  # the echoed prompt and the newline before the statistics are not in it
    # its generated_tokens are those after the first, which the prefill gives
    assert (out.prompt_tokens, out.generated_tokens, out.peak_rss_kib, out.seconds) == (5, 5, 1234, 2.5)
    assert out.load_s == pytest.approx(0.25)
    assert out.prefill_tok_s == pytest.approx(5 / 0.1)
    assert out.decode_tok_s == pytest.approx(4 / 0.3)  # tokens after the first, over the time after it
    with pytest.raises(ZLError, match="printed no PyTorchObserver line; is it ExecuTorch's llama_main"):
        parse_output(b"Hello world\n", "Hello", 0, 0, ["llama_main"])
    with pytest.raises(ZLError, match="did not echo the prompt first"):
        parse_output(b"Bye\n" + observer_line(), "Hello", 0, 0, ["llama_main"])


def test_printed_text_is_what_safe_printf_prints_of_each_piece(tmp_path):
    """Byte tokens through the byte-level alphabet; a lone byte that is neither printable nor space dropped, as
    ExecuTorch's safe_printf drops it; a special token printed as its content, a newline after the one that ends the
    generation."""
    from zl_device.results.llm_runner import printed_text
    from zl_export.inference_program import write_tokenizer_files
    from zl_export.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    write_tokenizer_files(tokenizer, tmp_path)
    ids = [ord("h"), ord("i"), 0x85, ord("\n"), 0x07, ord(" "), tokenizer.eos_token_id]
    assert printed_text(tmp_path / "tokenizer.json", ids) == b"hi\n <eos>"
    # an end of sequence that stops the loop is followed by a newline; the prefill's first token is not checked
    eos = {tokenizer.eos_token_id}
    assert printed_text(tmp_path / "tokenizer.json", ids, eos) == b"hi\n <eos>\n"
    assert printed_text(tmp_path / "tokenizer.json", [tokenizer.eos_token_id, ord("a")], eos) == b"<eos>a"


def fake_llama_main(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_run_llama_main_runs_the_command_and_one_line_errors(tmp_path):
    from zl_device.results.llm_runner import llama_main_command, run_llama_main

    observer = observer_line().decode().strip().replace('"', '\\"')
    good = fake_llama_main(tmp_path / "good", f'printf "Hi you\\n{observer}\\n"\n')
    command = llama_main_command(good, tmp_path / "m.pte", tmp_path / "tokenizer.json", "Hi", 8, data_path=Path("b.ptd"),
                                 num_bos=1)
    assert command[1:] == [f"--model_path={tmp_path / 'm.pte'}", f"--tokenizer_path={tmp_path / 'tokenizer.json'}",
                           "--prompt=Hi", "--temperature=0", "--max_new_tokens=8", "--cpu_threads=1", "--num_bos=1",
                           "--warmup=false", "--data_paths=b.ptd"]
    out = run_llama_main(command, "Hi")
    assert out.text == b" you" and out.generated_tokens == 5 and out.peak_rss_kib > 0
    bad = fake_llama_main(tmp_path / "bad", 'echo "E 00:00:00.1 executorch:program.cpp] Program identifier mismatch" >&2; exit 1\n')
    with pytest.raises(ZLError, match=r"bad failed \(exit 1\): E 00:00:00.1 .*Program identifier mismatch$"):
        run_llama_main([str(bad)], "Hi")
    with pytest.raises(ZLError, match=r"cannot run it .*tools/build_llm_runner.sh"):
        run_llama_main([str(tmp_path / "absent")], "Hi")
    slow = fake_llama_main(tmp_path / "slow", "sleep 30\n")
    with pytest.raises(ZLError, match=r"no answer in 1 s"):
        run_llama_main([str(slow)], "Hi", timeout=1)


def aarch64_elf(path: Path) -> Path:
    """A file that reads as an AArch64 ELF executable (e_machine 183) to `elf_machine`."""
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    header[18:20] = (183).to_bytes(2, "little")
    path.write_bytes(bytes(header))
    return path


def test_the_llm_runner_for_each_kind_of_device(tmp_path, monkeypatch):
    """Host devices get the host build, phones the aarch64 one (an x86 file refused in one line), the app none."""
    from types import SimpleNamespace

    from zl_device.devices import deploy

    phone, local, app = (SimpleNamespace(kind="adb", runs_runner_binary=True),
                         SimpleNamespace(kind="local", runs_runner_binary=True),
                         SimpleNamespace(kind="adb", runs_runner_binary=False))
    monkeypatch.setattr(deploy, "HOST_LLAMA_MAIN", tmp_path / "x86_64" / "llama_main")
    monkeypatch.setattr(deploy, "PHONE_LLAMA_MAIN", tmp_path / "aarch64" / "llama_main")
    for name in (deploy.LLAMA_MAIN_ENV, deploy.HOST_LLAMA_MAIN_ENV):
        monkeypatch.delenv(name, raising=False)
    assert deploy.llm_runner_for(phone) is None and deploy.llm_runner_for(local) is None  # not built: no push
    (tmp_path / "aarch64").mkdir()
    arm = aarch64_elf(tmp_path / "aarch64" / "llama_main")
    assert deploy.llm_runner_for(phone) == arm and deploy.llm_runner_for(app) is None
    host = Path(sys.executable).resolve()
    monkeypatch.setenv(deploy.HOST_LLAMA_MAIN_ENV, str(host))
    assert deploy.llm_runner_for(local) == host
    monkeypatch.setenv(deploy.LLAMA_MAIN_ENV, str(host))
    with pytest.raises(ZLError, match=r"is not an AArch64 ELF executable \(x86_64\).*tools/build_llm_runner.sh"):
        deploy.llm_runner_for(phone)
    monkeypatch.setenv(deploy.LLAMA_MAIN_ENV, str(tmp_path / "nope"))
    with pytest.raises(ZLError, match=r"^ZL_LLAMA_MAIN=.*nope: no such file; build llama_main with"):
        deploy.llm_runner_for(phone)


def test_deploy_program_pushes_llama_main_and_says_how_to_run_it(tmp_path, monkeypatch):
    from zl.commands.devices import deploy_command
    from zl_device.devices import deploy
    from zl_export.inference_program import write_tokenizer_files
    from zl_export.program_record import NEEDED_METHODS, write_program_record
    from zl_export.tokenizer import ByteTokenizer

    program = tmp_path / "out" / "model.pte"
    program.parent.mkdir()
    program.write_bytes(b"\0" * 1024)
    files = write_tokenizer_files(ByteTokenizer(), program.parent)
    write_program_record(program, "tiny-random", "none", 48, "in-place", list(NEEDED_METHODS), files)
    app = typer.Typer(add_completion=False)
    app.command("deploy")(deploy_command)
    app.command("unused")(lambda: None)
    runner = fake_llama_main(tmp_path / "llama_main", "exit 0\n")
    monkeypatch.setenv(deploy.HOST_LLAMA_MAIN_ENV, str(runner))
    result = CliRunner().invoke(app, ["deploy", "--devices", "local:1", "--run-dir", str(tmp_path / "run"),
                                      "--program", str(program)])
    assert result.exit_code == 0, result.output
    work = tmp_path / "run" / "devices" / "local-0"
    assert (work / "llama_main").read_bytes() == runner.read_bytes() and os.access(work / "llama_main", os.X_OK)
    text = " ".join(result.stdout.split())
    assert "local-0: program: pushed 5 files" in text and "llama_main)" in text
    assert (f"run the program on local-0: cd {work} && ./llama_main --model_path=model.pte "
            "--tokenizer_path=tokenizer.json --temperature=0 --prompt='Hello'") in text
    monkeypatch.delenv(deploy.HOST_LLAMA_MAIN_ENV)
    monkeypatch.setattr(deploy, "HOST_LLAMA_MAIN", tmp_path / "not-built")
    result = CliRunner().invoke(app, ["deploy", "--devices", "local:1", "--run-dir", str(tmp_path / "run2"),
                                      "--program", str(program)])
    assert result.exit_code == 0, result.output
    assert ("llama_main (ExecuTorch's LLM runner) is not built, so none was pushed; build it with "
            "`ZL_EXECUTORCH_SRC=<ExecuTorch checkout> tools/build_llm_runner.sh`") in " ".join(result.stdout.split())


HOST = ROOT / "build-llm" / "x86_64" / "llama_main"
PHONE = ROOT / "build-llm" / "aarch64" / "llama_main"


@pytest.fixture(scope="module")
def tiny_programs(tmp_path_factory):
    sys.path.insert(0, str(ROOT))
    from tools.check_llm_runner import tiny_programs as export

    return export(tmp_path_factory.mktemp("programs"))


def check(runner: Path, programs: list[Path], emulator: list[str], capsys) -> None:
    from tools.check_llm_runner import PROMPTS, check_program

    for program in programs:
        assert check_program(program, runner, emulator, list(PROMPTS), 12, 1), capsys.readouterr().out


@pytest.mark.skipif(not HOST.is_file(), reason="no build-llm/x86_64/llama_main (tools/build_llm_runner.sh)")
def test_host_llama_main_continues_as_the_python_runtime(tiny_programs, capsys):
    check(HOST, tiny_programs, [], capsys)


@pytest.mark.slow
@pytest.mark.skipif(not PHONE.is_file() or not shutil.which("qemu-aarch64"),
                    reason="no build-llm/aarch64/llama_main (tools/build_llm_runner.sh) or no qemu-aarch64")
def test_phone_llama_main_under_qemu_continues_as_the_python_runtime(tiny_programs, capsys):
    check(PHONE, tiny_programs, ["env", "-i", "qemu-aarch64"], capsys)


@pytest.mark.slow
@pytest.mark.skipif(not HOST.is_file(), reason="no build-llm/x86_64/llama_main (tools/build_llm_runner.sh)")
def test_smollm2_programs_in_llama_main(tmp_path, capsys):
    """Real weights (SmolLM2-135M with a random adapter), float and int8: the host build against the Python runtime
    (float identical, int8 measured), and the phone build's float under qemu where it is built."""
    from tools.check_llm_runner import tiny_programs
    from zl_export import model_source

    try:
        model_source.resolve("smollm2-135m")
    except ZLError as e:
        pytest.skip(str(e))
    programs = tiny_programs(tmp_path, "smollm2-135m", ("none", "int8"))
    check(HOST, programs, [], capsys)
    if PHONE.is_file() and shutil.which("qemu-aarch64"):
        check(PHONE, programs[:1], ["env", "-i", "qemu-aarch64"], capsys)
