// Builds the c10d shim against the PyTorch wheel torch-sys found (DEP_TCH_LIBTORCH_LIB is
// `<torch>/lib`), with Debian's libgloo-dev for the Gloo headers the wheel lacks, and sets
// an rpath so the trainer finds libtorch without LD_LIBRARY_PATH.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=csrc/c10d_shim.cpp");
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not report libtorch's lib dir (set LIBTORCH_USE_PYTORCH=1)"),
    );
    let torch = lib
        .parent()
        .expect("<torch>/lib has a parent")
        .to_path_buf();
    let include = torch.join("include");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file("csrc/c10d_shim.cpp")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include("/usr/include")
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .define("USE_C10D_GLOO", None)
        .warnings(false);
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        build
            .define("USE_C10D_NCCL", None)
            .define("FSDP_WITH_NCCL", None);
        // The CUDA runtime and NCCL headers come with the wheel's nvidia packages: one
        // `nvidia/cu13` tree for CUDA 13 wheels (torch 2.10 on), one package per library
        // for CUDA 12 ones.
        let site = torch.parent().expect("site-packages");
        // torch's headers include cuda_runtime.h, which needs the compiler's `crt/` and
        // CCCL's `nv/` headers: the wheel's dependencies do not bring them.
        let cu13 = site.join("nvidia/cu13/include");
        if cu13.is_dir() && !cu13.join("crt/host_config.h").is_file() {
            panic!(
                "--features cuda: {} lacks crt/host_config.h (and CCCL's nv/target), which the \
                 PyTorch wheel's dependencies do not install; install them beside it: \
                 pip install 'nvidia-cuda-crt==13.0.*' 'nvidia-cuda-cccl==13.0.*'",
                cu13.display()
            );
        }
        for sub in [
            "nvidia/cu13/include",
            "nvidia/cuda_runtime/include",
            "nvidia/nccl/include",
        ] {
            if site.join(sub).is_dir() {
                build.include(site.join(sub));
            }
        }
    }
    build.compile("fsdp_c10d_shim");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}
