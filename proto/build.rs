// Protobufs are compiled with protox (pure Rust), so building needs no system `protoc`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/fsdp/v1/records.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
