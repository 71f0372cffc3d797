//! Generates the HLO protobuf types from `proto/` with a pure-Rust protobuf parser (protox), so a
//! fresh machine needs no `protoc`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/xla_hlo_subset.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    // BTreeMap: map fields (frontend attributes) serialize in a fixed order, so the same graph
    // always gives the same bytes, and the NEFF cache key (a hash of them) is stable.
    prost_build::Config::new()
        .btree_map(["."])
        .compile_fds(descriptors)?;
    Ok(())
}
