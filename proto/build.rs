// Protobufs are compiled with protox (pure Rust), so building needs no system `protoc`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/fsdp/v1/records.proto", "proto/fsdp/v1/status.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    // Kept for gRPC server reflection, so `grpcurl` works against an agent without .proto files.
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("fsdp_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure().compile_fds(descriptors)?;

    // The embedded store serves this subset of etcd's API; the agent talks to it through
    // etcd-client, so only the server side is generated.
    let store = "proto/etcdserverpb/store.proto";
    println!("cargo:rerun-if-changed={store}");
    tonic_prost_build::configure()
        .build_client(false)
        .compile_fds(protox::compile([store], ["proto"])?)?;
    Ok(())
}
