//! What `cargo package` ships: the code and what building it and reading it need, not the
//! repository (tests, scripts, images, benchmarks' measurements): 170 files and 2.1 MiB before
//! `include` was set in Cargo.toml.

use std::process::Command;

/// The files `cargo package --list` would ship.
fn shipped() -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo)
        .args(["package", "--list", "--allow-dirty", "--offline"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo package --list");
    assert!(
        output.status.success(),
        "cargo package --list failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_package_ships_the_code_and_its_docs_not_the_repository() {
    let files = shipped();
    let unwanted: Vec<&String> = (files.iter())
        .filter(|file| {
            ["tests/", "scripts/", "benches/", "examples/", ".ci"]
                .iter()
                .any(|dir| file.starts_with(dir))
                || file.ends_with(".png")
                || *file == "BENCHMARKS.md"
        })
        .collect();
    assert!(unwanted.is_empty(), "shipped: {unwanted:?}");
    // What the build, the doctests and the README's links need.
    for needed in [
        "src/lib.rs",
        "src/backend/lua/gcra.lua",
        "src/backend/lua/semaphore/ops.lua",
        "src/bin/dlimit/page.html",
        "README.md",
        "docs/adaptive.md",
        "docs/operations.md",
        "CHANGELOG.md",
        "LICENSE-APACHE",
        "LICENSE-MIT",
    ] {
        assert!(files.iter().any(|file| file == needed), "{needed} missing");
    }
}
