"""The kernel library's build and load checks, with the real nvcc (skipped without it). Loading
needs no GPU: the library links the CUDA runtime statically and calls it only when used."""

from __future__ import annotations

import array
import ctypes
import struct
import subprocess

import pytest

from kvdepot.gpu import build
from kvdepot.gpu.kernels import ABI_VERSION, KernelError, Kernels

pytestmark = pytest.mark.skipif(build.find_nvcc() is None, reason="needs nvcc")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels") / "libkvdepot_kernels.so"
    build.build(out, ["90"])
    return out


def test_built_library_loads_with_its_abi_and_source_stamp(built):
    k = Kernels(str(built))
    assert k.lib.kvd_abi_version() == ABI_VERSION
    assert k.lib.kvd_source_hash().decode() == build.source_hash()
    assert k.ipc_handle_bytes == 64 and k.ipc_event_handle_bytes == 64
    # argument checks answer before any CUDA call (no GPU here)
    notified = ctypes.c_int(7)
    assert k.lib.kvd_store(0, 0, 0, 1, 0, 1, 0, -1, 1, ctypes.addressof(notified)) == 1  # KVD_EINVAL
    assert notified.value == 0
    assert k.lib.kvd_retrieve(0, 0, 0, 1, 1, 0, 0, 0, -1, 1, ctypes.addressof(notified)) == 1
    # a deferred copy's fence word must be 8-byte aligned; a request no lane can take is refused
    assert k.lib.kvd_dma(0, 0, 0, 8, 8, 64, 1, 1, 0, -1, 1, ctypes.addressof(notified), 0, 0) == 1
    # and so must a gated retrieve's landed word
    assert k.lib.kvd_dma(1, 0, 0, 8, 8, 64, 1, 0, 0, -1, 1, ctypes.addressof(notified), 12, 1) == 1
    # the same through its one-pointer argument block (KvdDmaCall: eleven 8-byte fields, then
    # 2n pointers), as the daemon's loop calls it; a null block or a bad count is refused too
    assert k.lib.kvd_dma_call(None) == 1
    block = ctypes.create_string_buffer(88 + 16)
    for n in (1, 0, -3):
        notified.value = 7
        struct.pack_into("=QQQQqqqQQQQ2Q", block, 0, 0, 0, 0, 64, n, 1, 2**32, 1, ctypes.addressof(notified), 0, 0,
                         8, 8)
        assert k.lib.kvd_dma_call(ctypes.addressof(block)) == 1  # no lane (n=1), no copies (n<=0)
        assert notified.value == 0
    assert k.lib.kvd_engine_signal(3, 1, 0) == 1  # misaligned word
    ids = (ctypes.c_int32 * 1)(0)  # a gated scatter: no engine, no landed word, a misaligned one
    assert k.lib.kvd_engine_scatter_gated(0, ids, 1, 256, 0, 8, None, 1, None) == 1
    assert k.lib.kvd_engine_scatter_gated(8, ids, 1, 256, 0, 0, None, 1, None) == 1
    assert k.lib.kvd_engine_scatter_gated(8, ids, 1, 256, 0, 12, None, 1, None) == 2  # KVD_EALIGN
    assert k.lib.kvd_lane_cancel(0, 0, 0) == -1
    with pytest.raises(KernelError, match="event handle of 3 bytes"):
        k.event_open_ipc(b"abc", 0)


def test_library_built_from_other_source_is_refused(tmp_path):
    stale = tmp_path / "stale.so"
    nvcc = build.find_nvcc()
    subprocess.run([nvcc, "-O0", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static",
                    "-gencode=arch=compute_90,code=sm_90", '-DKVD_SOURCE_HASH="0123456789abcdef"', "-o", str(stale),
                    str(build.SRC)], check=True)
    with pytest.raises(KernelError, match="built from other source"):
        Kernels(str(stale))


def test_a_failed_build_leaves_no_partial_file(tmp_path):
    out = tmp_path / "lib.so"
    with pytest.raises(subprocess.CalledProcessError):
        build.build(out, ["not-an-arch"])
    assert list(tmp_path.iterdir()) == []


def test_engine_launches_check_their_arguments(built):
    """A bad argument to the engine side's launches is the library's typed error, caught before
    any CUDA call (no GPU needed)."""
    k = Kernels(str(built))
    with pytest.raises(KernelError, match="kvd_engine_signal"):
        k.engine_signal(12, 1, 0)  # a fence word must be 8-byte aligned
    with pytest.raises(KernelError, match="kvd_engine_gather"):
        k.engine_gather(0, array.array("i", [0]), 1, 256, 0)  # no engine
    # the fence word written in the gather's call must be 8-byte aligned too (checked before the
    # engine is read: the handle here is never dereferenced)
    ids = array.array("i", [0])
    assert k.lib.kvd_engine_gather(8, ids.buffer_info()[0], 1, 256, 12, 1, 0) == 2  # KVD_EALIGN

    # several pieces by one call: every region, word and count is checked before the engine is read
    def q(*xs):
        return array.array("Q", xs)

    with pytest.raises(KernelError, match="kvd_engine_gather_pieces"):
        k.engine_gather_pieces(0, ids, q(256), array.array("q", [1]), q(8), q(1), 0)  # no engine
    with pytest.raises(KernelError, match="2 pieces, 1 regions"):
        k.engine_gather_pieces(8, ids, q(256), array.array("q", [1, 1]), q(8, 16), q(1, 2), 0)

    def raw(total, dsts, chunks, words):
        return k.lib.kvd_engine_gather_pieces(8, ids.buffer_info()[0], total, len(chunks), dsts.buffer_info()[0],
                                              chunks.buffer_info()[0], words.buffer_info()[0],
                                              q(*[1] * len(chunks)).buffer_info()[0], 0)

    assert raw(2, q(256, 100), array.array("q", [1, 1]), q(8, 16)) == 2  # a region not 256-aligned
    assert raw(2, q(256, 512), array.array("q", [1, 1]), q(8, 0)) == 2  # a word of 0
    assert raw(2, q(256, 512), array.array("q", [1, 1]), q(8, 12)) == 2  # a word not 8-byte aligned
    assert raw(2, q(256, 512), array.array("q", [2, 0]), q(8, 16)) == 1  # a piece of no chunk (KVD_EINVAL)
    assert raw(3, q(256, 512), array.array("q", [1, 1]), q(8, 16)) == 1  # counts that do not add up


def test_the_source_stamp_covers_every_file_of_the_translation_unit(tmp_path, monkeypatch):
    """A change in any file the .cu includes changes the stamp (a library built before it is
    refused), and the .cu includes exactly the parts the stamp hashes."""
    import shutil

    src_dir = tmp_path / "csrc"
    shutil.copytree(build.SRC.parent, src_dir)
    monkeypatch.setattr(build, "SRC", src_dir / build.SRC.name)
    text = build.SRC.read_text()
    assert [line.split('"')[1] for line in text.splitlines() if line.startswith('#include "')] == list(build.PARTS)
    before = build.source_hash()
    for part in build.PARTS:
        p = src_dir / part
        p.write_text(p.read_text() + "\n// changed\n")
        after = build.source_hash()
        assert after != before
        before = after
