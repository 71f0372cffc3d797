//! Generates the HLO protobuf types from `proto/` with a pure-Rust protobuf parser (protox), so a
//! fresh machine needs no `protoc`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/xla_hlo_subset.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
