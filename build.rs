//! Build script. The HLO protobuf types are generated here once the lowering lands; until then it
//! only asks cargo not to rerun on unrelated changes.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
}
