// Protobufs are compiled with protox (pure Rust), so building needs no system `protoc`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/fsdp/v1/records.proto", "proto/fsdp/v1/status.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let mut descriptors = protox::compile(files, ["proto"])?;
    // Kept for gRPC server reflection, so `grpcurl` works against an agent without .proto files.
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("fsdp_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    // A member is generated as `MemberFields`, and `fsdp.v1.Member` wherever a record holds
    // one is `member::Member`, a shared handle to those fields: every agent applies each
    // new round to the one it holds, and at 1,000 members copying every member's strings
    // was thousands of allocations per agent per re-form. The wire format is
    // the proto's own.
    let records = descriptors
        .file
        .iter_mut()
        .find(|f| f.package() == "fsdp.v1" && f.name().ends_with("records.proto"))
        .ok_or("records.proto has no fsdp.v1 package")?;
    let at = records
        .message_type
        .iter()
        .position(|m| m.name() == "Member")
        .ok_or("records.proto has no Member")?;
    let mut fields = records.message_type[at].clone();
    fields.name = Some("MemberFields".into());
    records.message_type.push(fields);
    // The copy's comments are the member's (the generator looks every message up there).
    let copy = i32::try_from(records.message_type.len() - 1)?;
    if let Some(info) = records.source_code_info.as_mut() {
        const MESSAGE_TYPE: i32 = 4;
        let at = i32::try_from(at)?;
        let copies: Vec<_> = info
            .location
            .iter()
            .filter(|l| l.path.starts_with(&[MESSAGE_TYPE, at]))
            .cloned()
            .map(|mut l| {
                l.path[1] = copy;
                l
            })
            .collect();
        info.location.extend(copies);
    }
    tonic_prost_build::configure()
        .extern_path(".fsdp.v1.Member", "crate::member::Member")
        .message_attribute(
            ".fsdp.v1.MemberFields",
            "///\n/// Generated as `MemberFields`: records hold these fields shared, as [`Member`].",
        )
        .compile_fds(descriptors)?;

    // The embedded store serves this subset of etcd's API; the agent talks to it through
    // etcd-client, so only the server side is generated.
    let store = "proto/etcdserverpb/store.proto";
    println!("cargo:rerun-if-changed={store}");
    tonic_prost_build::configure()
        .build_client(false)
        .compile_fds(protox::compile([store], ["proto"])?)?;
    Ok(())
}
