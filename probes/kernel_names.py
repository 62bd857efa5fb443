"""A kernel's base name: what the kernel is called without its template and parameter lists.

Rules classify on the base name, so a template argument or a parameter type never decides the
class: ``finalizeKernelVecLoad<...cutlass::bfloat16_t...>`` is ``moe::dev::finalize::finalizeKernelVecLoad``,
not a CUTLASS GEMM. The rest of the name (template arguments and parameters) is kept apart as the
kernel's *arguments*, which a rule may test with ``args:`` (``at::native::reduce_kernel`` computes
an argmax or a mean depending on its functor).

- demangled C++: ``void ns::kernel<T, 4>(T*, int)`` -> ``ns::kernel``; return types
  (``std::enable_if<...>::type``) and ``(anonymous namespace)`` are dropped;
- Itanium-mangled (``_ZN5aiter24add_rmsnorm_quant_kernelI...``, as ROCm traces show them) ->
  ``aiter::add_rmsnorm_quant_kernel``; the mangled tail is the arguments;
- launch wrappers whose first template argument is the real kernel (``cutlass::Kernel2<X>``,
  ``cutlass::device_kernel<X>``, ``ck_tile::kentry<N, X<...>>``) -> the base name of ``X``;
- anything else (Triton, cuBLAS, nvjet, Tensile ``Cijk_*``) is its own base name.
"""

from __future__ import annotations

import re
from functools import lru_cache

WRAPPERS = ("cutlass::Kernel", "cutlass::Kernel2", "cutlass::device_kernel", "ck_tile::kentry",
            "cute::device_kernel", "at::cuda::detail::launch_kernel")
_ANON = re.compile(r"\((?:anonymous|anon) namespace\)::|<unnamed>::")
_SOURCE_NAME = re.compile(r"(?<!\d)(\d+)(?=[A-Za-z_])")


def _split_top(text: str) -> tuple[str, str]:
    """(head without top-level template lists, the first top-level '(' on: the parameter list)."""
    stack: list[str] = []
    head = []
    for i, ch in enumerate(text):
        if ch == "<":
            stack.append("<")
        elif ch == ">":
            if stack and stack[-1] == "<":
                stack.pop()
        elif ch == "(":
            if not stack:
                return "".join(head), text[i:]
            stack.append("(")
        elif ch == ")":
            if stack and stack[-1] == "(":
                stack.pop()
        elif not stack:
            head.append(ch)
    return "".join(head), ""


def _template_args(text: str, base_end: int) -> list[str]:
    """Top-level arguments of the template list starting at ``text[base_end]`` ('<')."""
    if base_end >= len(text) or text[base_end] != "<":
        return []
    stack: list[str] = []
    cur: list[str] = []
    out: list[str] = []
    for ch in text[base_end:]:
        if ch in "<(":
            stack.append(ch)
            if len(stack) == 1:
                continue
        elif ch == ">" and stack and stack[-1] == "<" or ch == ")" and stack and stack[-1] == "(":
            stack.pop()
            if not stack:
                out.append("".join(cur).strip())
                break
        elif ch == "," and len(stack) == 1:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    return out


def _demangled_base(name: str) -> str:
    head, _ = _split_top(name)
    tokens = head.split()
    return tokens[-1] if tokens else name


def _mangled(name: str) -> tuple[str, str] | None:
    """(base, rest) of an Itanium-mangled name, or None when it is not one."""
    m = re.match(r"_Z(N?)(?:[rVK]*)", name)
    if m is None:
        return None
    i = m.end()
    parts = []
    while i < len(name):
        d = re.match(r"\d+", name[i:])
        if d is None:
            break
        n = int(d.group())
        j = i + len(d.group())
        ident = name[j:j + n]
        if len(ident) < n or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", ident):
            break
        parts.append("(anonymous namespace)" if ident == "_GLOBAL__N_1" else ident)
        i = j + n
        if not m.group(1):
            break
    if not parts:
        return None
    parts = [p for p in parts if p != "(anonymous namespace)"]
    base, rest = "::".join(parts), name[i:]
    if base in WRAPPERS and rest.startswith("I"):
        # the first source name inside the template list is the wrapped kernel
        for sm in _SOURCE_NAME.finditer(rest):
            n = int(sm.group(1))
            ident = rest[sm.end():sm.end() + n]
            if n > 2 and len(ident) == n and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", ident):
                return f"{base.split('::')[0]}::{ident}", rest
    return base, rest


@lru_cache(maxsize=65536)
def split_name(name: str) -> tuple[str, str]:
    """(base name, arguments) of a kernel name as a trace records it."""
    s = name.strip()
    if s.startswith("_Z"):
        got = _mangled(s)
        if got is not None:
            return got
    s = _ANON.sub("", s)
    base = _demangled_base(s)
    pos = s.find(base)
    rest = s[pos + len(base):] if pos >= 0 else ""
    for _ in range(3):  # unwrap nested launch wrappers
        if base not in WRAPPERS:
            break
        args = _template_args(s, pos + len(base))
        inner = next((a for a in args if a and not re.fullmatch(r"[-\d\s()a-z]*", a)), None)
        if inner is None:
            break
        s = inner
        base = _demangled_base(s)
        pos = s.find(base)
    return base or name, rest


def base_name(name: str) -> str:
    return split_name(name)[0]
