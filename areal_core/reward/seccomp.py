"""A seccomp filter for the code sandbox, as the classic-BPF program bubblewrap's `--seccomp FD`
loads: the kernel interfaces a graded program never needs and that widen the kernel's attack
surface are refused with EPERM:

    io_uring_setup/enter/register, keyctl, add_key, request_key, bpf, perf_event_open,
    userfaultfd, and socket(AF_NETLINK, ...)

A system call made under another ABI (i386 on x86_64, x32's numbers) is refused the same way
rather than looked up under the wrong table; a process of another architecture is killed.
Each instruction is struct sock_filter {u16 code; u8 jt; u8 jf; u32 k} (linux/filter.h) over
struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]} (linux/seccomp.h).
"""

from __future__ import annotations

import errno
import platform
import struct

LD_ABS_W, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
NR, ARCH, ARG0 = 0, 4, 16  # offsets in seccomp_data (args[0]'s low 32 bits on little-endian)
X32_BIT = 0x40000000
AF_NETLINK = 16

# (audit arch, {name: syscall number}, socket's number) per machine
TABLES = {
    "x86_64": (
        0xC000003E,
        {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 250, "add_key": 248,
         "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323},
        41,
    ),
    "aarch64": (
        0xC00000B7,
        {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 219, "add_key": 217,
         "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282},
        198,
    ),
}  # fmt: skip
DENIED = tuple(TABLES["x86_64"][1])


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def deny_filter(machine: str | None = None) -> bytes:
    """The filter for `machine` (default: this one's); ValueError for a machine without a table."""
    machine = machine or platform.machine()
    if machine not in TABLES:
        raise ValueError(f"no seccomp syscall table for {machine!r} (known: {sorted(TABLES)})")
    arch, numbers, socket_nr = TABLES[machine]
    denied = list(numbers.values())
    # layout: [ld arch, jeq arch, ld nr, jge x32, jeq denied..., jeq socket, ld arg0, jeq netlink, ALLOW, DENY, KILL]
    n = len(denied)
    allow = 4 + n + 3
    deny, kill = allow + 1, allow + 2
    prog = [_ins(LD_ABS_W, ARCH), _ins(JEQ_K, arch, 0, kill - 2), _ins(LD_ABS_W, NR)]
    prog.append(_ins(JGE_K, X32_BIT, deny - 4, 0))
    for i, nr in enumerate(denied):
        at = 4 + i
        prog.append(_ins(JEQ_K, nr, deny - at - 1, 0))
    at = 4 + n
    prog.append(_ins(JEQ_K, socket_nr, 0, allow - at - 1))
    prog.append(_ins(LD_ABS_W, ARG0))
    prog.append(_ins(JEQ_K, AF_NETLINK, deny - (at + 2) - 1, 0))
    prog += [_ins(RET_K, RET_ALLOW), _ins(RET_K, RET_ERRNO | errno.EPERM), _ins(RET_K, RET_KILL_PROCESS)]
    assert len(prog) == kill + 1
    return b"".join(prog)
