"""The project's SHA-256 against NIST vectors and hashlib, on every path this CPU has."""

from __future__ import annotations

import hashlib
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from preloop import _native

IMPLS = ["portable"] + (["hardware"] if _native.sha256_hardware_available() else [])

# FIPS 180-4 examples (NIST CSRC "SHA256.pdf", "SHA2_Additional.pdf").
NIST = [
    (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (
        b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
    ),
    (
        b"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmno"
        b"ijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu",
        "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1",
    ),
    (b"\xbd", "68325720aabd7c82f30f554b313d0570c95accbb7dc4b5aae11204c08ffe732b"),
    (b"\xc9\x8c\x8e\x55", "7abc22c0ae5af26ce93dbb94433a0e0b2e119d014f8e7f65bd56c61ccccd9504"),
    (b"\x00" * 55, "02779466cdec163811d078815c633f21901413081449002f24aa3e80f0b88ef7"),
    (b"\x00" * 56, "d4817aa5497628e7c77e6b606107042bbba3130888c5f47a375e6179be789fbb"),
    (b"\x00" * 57, "65a16cb7861335d5ace3c60718b5052e44660726da4cd13bb745381b235a1785"),
    (b"\x00" * 64, "f5a5fd42d16a20302798ef6ed309979b43003d2320d9f0e8ea9831a92759fb4b"),
    (b"\x00" * 1000, "541b3e9daa09b20bf85fa273e5cbd3e80185aa4ec298e765db87742b70138a53"),
    (b"A" * 1000, "c2e686823489ced2017f6059b8b239318b6364f6dcd835d0a519105a1eadd6e4"),
    (b"U" * 1005, "f4d62ddec0f3dd90ea1380fa16a5ff8dc4c54b21740650f24afc4120903552b0"),
]


def digest(data: bytes, impl: str) -> bytes:
    h = _native.Sha256(impl)
    h.update(data)
    return h.digest()


def test_this_machine_reports_its_path() -> None:
    assert _native.sha256_default_impl() in ("sha-ni", "armv8-ce", "portable")
    if _native.sha256_hardware_available():
        assert _native.sha256_default_impl() != "portable"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("message", "expected"), NIST)
def test_nist_vectors(impl: str, message: bytes, expected: str) -> None:
    assert digest(message, impl).hex() == expected


@pytest.mark.parametrize("impl", IMPLS)
def test_one_million_a(impl: str) -> None:
    h = _native.Sha256(impl)
    for _ in range(1000):
        h.update(b"a" * 1000)
    assert h.digest().hex() == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"


@pytest.mark.parametrize("impl", IMPLS)
def test_every_length_0_to_300_matches_hashlib(impl: str) -> None:
    rng = random.Random(300)
    for length in range(301):
        data = rng.randbytes(length)
        assert digest(data, impl) == hashlib.sha256(data).digest(), length


@pytest.mark.parametrize("impl", IMPLS)
def test_large_stream_in_random_chunks_matches_hashlib(impl: str) -> None:
    rng = random.Random(7)
    data = rng.randbytes(3 * 1024 * 1024 + 17)
    h = _native.Sha256(impl)
    pos = 0
    while pos < len(data):
        step = rng.choice([1, 63, 64, 65, 200, 4096, 70000, 300001])
        h.update(data[pos : pos + step])
        pos += step
    assert h.digest() == hashlib.sha256(data).digest()
    assert digest(data, impl) == hashlib.sha256(data).digest()


def test_paths_agree_on_random_inputs() -> None:
    rng = random.Random(11)
    for _ in range(200):
        data = rng.randbytes(rng.randrange(0, 5000))
        assert {digest(data, impl) for impl in IMPLS} == {hashlib.sha256(data).digest()}


def test_unknown_or_unavailable_path_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown SHA-256"):
        _native.Sha256("md5")
    if not _native.sha256_hardware_available():
        with pytest.raises(ValueError, match="not available"):
            _native.Sha256("hardware")


def test_digest_once() -> None:
    h = _native.Sha256()
    h.digest()
    with pytest.raises(ValueError):
        h.update(b"x")


@pytest.mark.skipif(
    not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64")),
    reason="needs gcc-aarch64-linux-gnu and qemu-user to check the ARMv8 path",
)
def test_armv8_crypto_extension_path_under_qemu(tmp_path: Path) -> None:
    native = Path(__file__).parents[1] / "src" / "native"
    binary = tmp_path / "sha256_paths"
    subprocess.run(
        ["aarch64-linux-gnu-gcc", "-static", "-O2", "-Wall", "-Wextra", "-Werror",
         f"-I{native}", str(Path(__file__).parent / "native" / "sha256_paths.c"),
         str(native / "sha256.c"), "-o", str(binary)],
        check=True,
    )  # fmt: skip
    out = subprocess.run(
        ["qemu-aarch64", "-cpu", "max", str(binary)], capture_output=True, text=True, check=True
    ).stdout
    assert "default: armv8-ce" in out
    assert NIST[1][1] in out
    assert "mismatches: 0" in out
