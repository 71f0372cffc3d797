#!/usr/bin/env python3
"""Compares proto/xla_hlo_subset.proto with XLA's own schema; exits 1 naming each mismatch.

Our subset keeps XLA's field numbers by hand (the emitted bytes must be an ordinary
HloModuleProto). It may omit messages, fields and enum values; it must never disagree with XLA
on what it declares: for every message, field and enum value of the subset, XLA must have the
same full name, and each field the same number, type (and message or enum type name),
cardinality (repeated or not) and, for repeated numbers, the same packed encoding.

XLA's schema comes from a wheel, read as data (nothing is imported from it, nothing is
compiled): either a `*_pb2.py` module, whose serialized FileDescriptorProto is the argument of
`AddSerializedFile(b"...")`, or a shared library that XLA's C++ protobuf code was compiled into,
which embeds the same serialized FileDescriptorProto (jaxlib's libjax_common.so does). The
subset is compiled to a descriptor with protoc (grpcio-tools). scripts/check_proto.sh pins the
versions and sets all of this up; run that, not this file.
"""

import argparse
import ast
import os
import subprocess
import sys
import tempfile
import zipfile

from google.protobuf import descriptor_pb2

F = descriptor_pb2.FieldDescriptorProto

# The XLA files our subset's messages live in (package xla).
XLA_FILES = ("xla/xla_data.proto", "xla/service/hlo.proto")

# FileDescriptorProto's top-level fields and the wire types they may use, to find where an
# embedded serialized descriptor ends (the bytes after it are not ours to parse).
FILE_FIELD_WIRE_TYPES = {
    1: {2}, 2: {2}, 3: {2}, 4: {2}, 5: {2}, 6: {2}, 7: {2}, 8: {2}, 9: {2},
    10: {0, 2}, 11: {0, 2}, 12: {2}, 14: {0}, 15: {2},
}

SCALAR_NUMERIC = {
    F.TYPE_DOUBLE, F.TYPE_FLOAT, F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_INT32, F.TYPE_FIXED64,
    F.TYPE_FIXED32, F.TYPE_BOOL, F.TYPE_UINT32, F.TYPE_ENUM, F.TYPE_SFIXED32,
    F.TYPE_SFIXED64, F.TYPE_SINT32, F.TYPE_SINT64,
}


def varint(data, pos):
    """Decodes the varint at `pos`; returns (value, next position), or (None, pos) if cut off."""
    value, shift = 0, 0
    while pos < len(data):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            break
    return None, pos


def encode_varint(n):
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def descriptor_end(data, start):
    """Where the serialized FileDescriptorProto starting at `start` ends: the first position
    that does not continue it with a well-formed top-level field."""
    pos = start
    while pos < len(data):
        tag, p = varint(data, pos)
        if tag is None or tag >> 3 not in FILE_FIELD_WIRE_TYPES:
            break
        if tag & 7 not in FILE_FIELD_WIRE_TYPES[tag >> 3]:
            break
        value, p = varint(data, p)
        if value is None:
            break
        if tag & 7 == 2:
            p += value
        if p > len(data):
            break
        pos = p
    return pos


def find_file_descriptors(blob, names):
    """Every serialized FileDescriptorProto in `blob` whose name is in `names`, by name.

    A candidate must parse and serialize back to exactly the bytes found, so a stray match
    cannot pass for the schema."""
    found = {}
    for name in names:
        needle = b"\n" + encode_varint(len(name)) + name.encode()
        start = blob.find(needle)
        while start != -1:
            end = descriptor_end(blob, start)
            raw = bytes(blob[start:end])
            try:
                fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
            except Exception:  # noqa: BLE001 - a false match; keep looking
                fd = None
            if fd is not None and fd.name == name and fd.SerializeToString() == raw:
                previous = found.get(name)
                if previous is not None and previous != fd:
                    sys.exit(f"check_proto: two different descriptors of {name} in one file")
                found[name] = fd
            start = blob.find(needle, start + 1)
    return found


def serialized_files_in_pb2(source):
    """The byte-string arguments of `AddSerializedFile(...)` in a generated `_pb2.py`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "AddSerializedFile"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, bytes)
        ):
            out.append(node.args[0].value)
    return out


def xla_schema_from_wheel(wheel):
    """XLA's FileDescriptorProtos from a wheel: its `_pb2.py` modules first, then (for the
    files still missing) its shared libraries. Returns ({name: descriptor}, {name: member})."""
    found, where = {}, {}
    with zipfile.ZipFile(wheel) as z:
        members = z.namelist()
        pb2 = [m for m in members if m.endswith("_pb2.py")]
        libs = sorted(
            (m for m in members if m.endswith(".so") or ".so." in m),
            key=lambda m: -z.getinfo(m).file_size,
        )
        for member in pb2 + libs:
            missing = [n for n in XLA_FILES if n not in found]
            if not missing:
                break
            data = z.read(member)
            blobs = serialized_files_in_pb2(data.decode("utf-8", "replace")) if member in pb2 else [data]
            for blob in blobs:
                for name, fd in find_file_descriptors(blob, missing).items():
                    found[name], where[name] = fd, member
    return found, where


def compile_subset(proto):
    """Our subset compiled by protoc (grpcio-tools) to a FileDescriptorProto."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "subset.pb")
        cmd = [
            sys.executable, "-m", "grpc_tools.protoc",
            f"-I{os.path.dirname(os.path.abspath(proto))}",
            f"--descriptor_set_out={out}",
            os.path.basename(proto),
        ]
        subprocess.run(cmd, check=True)
        with open(out, "rb") as f:
            fds = descriptor_pb2.FileDescriptorSet.FromString(f.read())
    (fd,) = fds.file
    return fd


def index(files):
    """Messages and enums of `files` by full name (".xla.ShapeProto"), nested ones included,
    each with the file it belongs to."""
    messages, enums = {}, {}

    def walk(prefix, fd, message_types, enum_types):
        for e in enum_types:
            enums[f"{prefix}.{e.name}"] = (e, fd)
        for m in message_types:
            name = f"{prefix}.{m.name}"
            messages[name] = (m, fd)
            walk(name, fd, m.nested_type, m.enum_type)

    for fd in files:
        walk(f".{fd.package}" if fd.package else "", fd, fd.message_type, fd.enum_type)
    return messages, enums


def packed(field, fd):
    """Whether a repeated scalar field is written packed, as its file's syntax decides."""
    if field.options.HasField("packed"):
        return field.options.packed
    if fd.syntax == "editions":
        for features in (field.options.features, fd.options.features):
            if features.HasField("repeated_field_encoding"):
                return features.repeated_field_encoding == descriptor_pb2.FeatureSet.PACKED
        return True
    return fd.syntax == "proto3"


def type_text(field):
    name = F.Type.Name(field.type)[len("TYPE_"):].lower()
    return f"{name} {field.type_name}" if field.type_name else name


def compare(ours, xla_files):
    """Every disagreement between our subset and XLA's schema, and notes that are not."""
    problems, notes = [], []
    xla_messages, xla_enums = index(xla_files)
    our_messages, our_enums = index([ours])
    checked = {"messages": 0, "fields": 0, "enum values": 0}

    for full, (m, fd) in sorted(our_messages.items()):
        checked["messages"] += 1
        if full not in xla_messages:
            problems.append(f"message {full[1:]}: XLA has no message of that name")
            continue
        x, xfd = xla_messages[full]
        if m.options.map_entry != x.options.map_entry:
            problems.append(f"message {full[1:]}: map entry here or in XLA, not both")
        by_name = {f.name: f for f in x.field}
        by_number = {f.number: f for f in x.field}
        for f in m.field:
            checked["fields"] += 1
            where = f"{full[1:]}.{f.name} = {f.number}"
            named, numbered = by_name.get(f.name), by_number.get(f.number)
            if named is None and numbered is None:
                reserved = f.name in x.reserved_name or any(
                    r.start <= f.number < r.end for r in x.reserved_range
                )
                why = "reserved (removed) in XLA" if reserved else "XLA has no such name or number"
                problems.append(f"{where}: {why}")
                continue
            if named is not None and named.number != f.number:
                problems.append(f"{where}: XLA numbers `{f.name}` {named.number}")
            if numbered is not None and numbered.name != f.name:
                problems.append(f"{where}: XLA's field {f.number} is `{numbered.name}`")
            if named is None or named.number != f.number:
                continue
            if (f.type, f.type_name) != (named.type, named.type_name):
                problems.append(f"{where}: type {type_text(f)} here, {type_text(named)} in XLA")
            rep, xrep = f.label == F.LABEL_REPEATED, named.label == F.LABEL_REPEATED
            if rep != xrep:
                problems.append(
                    f"{where}: {'repeated' if rep else 'singular'} here, "
                    f"{'repeated' if xrep else 'singular'} in XLA"
                )
            elif rep and f.type in SCALAR_NUMERIC and packed(f, fd) != packed(named, xfd):
                problems.append(
                    f"{where}: {'packed' if packed(f, fd) else 'unpacked'} here, "
                    f"{'packed' if packed(named, xfd) else 'unpacked'} in XLA"
                )
            if named.options.deprecated:
                notes.append(f"{where}: deprecated in XLA")
            if named.HasField("oneof_index") and not named.proto3_optional:
                oneof = x.oneof_decl[named.oneof_index].name
                if not f.HasField("oneof_index"):
                    notes.append(f"{where}: in XLA's oneof `{oneof}` (same bytes on the wire)")

    for full, (e, _) in sorted(our_enums.items()):
        if full not in xla_enums:
            problems.append(f"enum {full[1:]}: XLA has no enum of that name")
            continue
        x, _ = xla_enums[full]
        by_name = {v.name: v.number for v in x.value}
        by_number = {}
        for v in x.value:
            by_number.setdefault(v.number, v.name)
        for v in e.value:
            checked["enum values"] += 1
            where = f"{full[1:]}.{v.name} = {v.number}"
            if v.name not in by_name:
                other = by_number.get(v.number)
                problems.append(
                    f"{where}: XLA has no such value"
                    + (f" (its {v.number} is `{other}`)" if other else "")
                )
            elif by_name[v.name] != v.number:
                problems.append(f"{where}: XLA numbers it {by_name[v.name]}")
    return problems, notes, checked


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--subset", required=True, help="our .proto (proto/xla_hlo_subset.proto)")
    ap.add_argument("--wheel", required=True, help="a wheel carrying XLA's compiled schema")
    ap.add_argument("--label", default=None, help="what the wheel is, for messages")
    args = ap.parse_args()
    label = args.label or os.path.basename(args.wheel)

    ours = compile_subset(args.subset)
    if ours.package != "xla":
        sys.exit(f"check_proto: {args.subset} declares package `{ours.package}`, XLA's is `xla`")
    xla, where = xla_schema_from_wheel(args.wheel)
    missing = [n for n in XLA_FILES if n not in xla]
    if missing:
        sys.exit(f"check_proto: {label} carries no descriptor of {', '.join(missing)}")
    for name in XLA_FILES:
        print(f"check_proto: XLA's {name} from {label}:{where[name]}")

    problems, notes, checked = compare(ours, [xla[n] for n in XLA_FILES])
    for n in notes:
        print(f"check_proto: note: {n}")
    counts = ", ".join(f"{v} {k}" for k, v in checked.items())
    if problems:
        for p in problems:
            print(f"check_proto: MISMATCH {p}", file=sys.stderr)
        n = len(problems)
        print(
            f"check_proto: {n} mismatch{'' if n == 1 else 'es'} between {args.subset} and XLA "
            f"({label}); checked {counts}",
            file=sys.stderr,
        )
        return 1
    print(f"check_proto: {args.subset} agrees with XLA ({label}): {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
