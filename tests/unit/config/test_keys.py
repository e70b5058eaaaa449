import os
import stat

import pytest
import zmq
from click.testing import CliRunner

from kvasir.cli.main import kvasir
from kvasir.config.keys import POOL_SECRET, KeyFileError, allowed_keys, load_pair, load_public, read_pool_secret


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_generate_makes_pairs_an_allow_list_and_private_secrets(tmp_path):
    folder = tmp_path / "keys"
    result = CliRunner().invoke(kvasir, ["keys", "generate", str(folder), "--client", "alice", "--client", "bob"])
    assert result.exit_code == 0, result.output
    for name in ("server", "alice", "bob"):
        public, secret = load_pair(folder / f"{name}.key_secret")
        assert load_public(folder / f"{name}.key") == public
        assert zmq.curve_public(secret) == public  # a real pair
        assert mode(folder / f"{name}.key_secret") == 0o600
    assert sorted(allowed_keys(folder / "clients")) == sorted(
        load_public(folder / f"{n}.key") for n in ("alice", "bob")
    )
    server = (folder / "server.key_secret").read_bytes()
    again = CliRunner().invoke(kvasir, ["keys", "generate", str(folder), "--client", "carol"])
    assert again.exit_code == 0 and (folder / "server.key_secret").read_bytes() == server  # kept
    refused = CliRunner().invoke(kvasir, ["keys", "generate", str(folder), "--client", "alice"])
    assert refused.exit_code == 2 and "already exists" in refused.output


def test_bad_key_files_are_named(tmp_path):
    (tmp_path / "junk.key").write_text("hello\n")
    with pytest.raises(KeyFileError, match="not a CURVE key file"):
        load_public(tmp_path / "junk.key")
    with pytest.raises(KeyFileError, match="not found"):
        load_pair(tmp_path / "missing.key_secret")
    (tmp_path / "short.key").write_text('curve\n    public-key = "abc"\n')
    with pytest.raises(KeyFileError, match="malformed"):
        load_public(tmp_path / "short.key")


def test_keys_generate_makes_each_hosts_pair_and_nothing_else(tmp_path):
    folder = tmp_path / "keys"
    result = CliRunner().invoke(kvasir, ["keys", "generate", str(folder), "--host", "a", "--host", "b"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in folder.iterdir()) == ["a.key", "a.key_secret", "b.key", "b.key_secret", POOL_SECRET]
    assert mode(folder / POOL_SECRET) == 0o600 and len(read_pool_secret(folder / POOL_SECRET)) == 32
    for name in ("a", "b"):
        public, secret = load_pair(folder / f"{name}.key_secret")
        assert zmq.curve_public(secret) == public == load_public(folder / f"{name}.key")
        assert mode(folder / f"{name}.key_secret") == 0o600 and mode(folder / f"{name}.key") == 0o644
    for args, expected in (
        (["--host", "a"], "already exists"),
        (["--host", "c", "--client", "c"], "given twice"),
        (["--host", "clients"], "cannot name a host key"),
    ):
        refused = CliRunner().invoke(kvasir, ["keys", "generate", str(folder), *args])
        assert refused.exit_code == 2 and expected in refused.output, refused.output
    assert not (folder / "c.key").exists()


def test_the_fleets_pool_secret_is_made_once_and_checked_when_read(tmp_path):
    folder = tmp_path / "keys"
    made = CliRunner().invoke(kvasir, ["keys", "generate", str(folder), "--pool-secret"])
    assert made.exit_code == 0 and made.output.split() == [str(folder / POOL_SECRET)], made.output
    secret = read_pool_secret(folder / POOL_SECRET)
    again = CliRunner().invoke(kvasir, ["keys", "generate", str(folder), "--pool-secret", "--host", "a"])
    assert again.exit_code == 0 and str(folder / POOL_SECRET) not in again.output  # kept
    assert read_pool_secret(folder / POOL_SECRET) == secret
    os.chmod(folder / POOL_SECRET, 0o644)
    with pytest.raises(KeyFileError, match="mode 0600"):
        read_pool_secret(folder / POOL_SECRET)
    (folder / POOL_SECRET).unlink()
    with pytest.raises(KeyFileError, match="kvasir keys generate .* --pool-secret"):
        read_pool_secret(folder / POOL_SECRET)


def test_a_secret_key_open_to_others_is_refused(tmp_path):
    from kvasir.config.keys import generate

    generate(tmp_path, ["alice"])
    secret = tmp_path / "alice.key_secret"
    assert load_pair(secret)[0] == load_pair(secret)[0]  # 0600 as made
    secret.chmod(0o644)
    with pytest.raises(KeyFileError, match=r"open to other users \(mode 0644\): chmod 600"):
        load_pair(secret)
