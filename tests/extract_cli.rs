//! `quarry extract` end to end with the real model: the ready-made invoice schema on a sample
//! document prints one object that validates; a schema that cannot compile is refused by name.

mod common;

use std::process::Command;

fn extract(schema: &str, document: &str) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_quarry"))
        .args([
            "extract",
            "--schema",
            schema,
            "--document",
            document,
            "--max-tokens",
            "256",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        stderr,
    )
}

#[test]
fn the_invoice_schema_on_a_sample_document_validates() {
    if common::model_path().is_none() {
        return;
    }
    let (ok, stdout, stderr) = extract("schemas/invoice.json", "examples/documents/invoice.txt");
    assert!(ok, "{stderr}");
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{}/schemas/invoice.json", env!("CARGO_MANIFEST_DIR"))).unwrap(),
    )
    .unwrap();
    let value: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(jsonschema::validator_for(&schema).unwrap().is_valid(&value), "{value}");
    assert!(stderr.contains("outcome: ok"), "{stderr}");

    let broken = std::env::temp_dir().join(format!("quarry-broken-{}.json", std::process::id()));
    std::fs::write(
        &broken,
        r##"{"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}"##,
    )
    .unwrap();
    let (ok, stdout, stderr) = extract(broken.to_str().unwrap(), "examples/documents/invoice.txt");
    assert!(
        !ok && stdout.is_empty() && stderr.contains("schema_rejected") && stderr.contains("$ref"),
        "{stderr}"
    );
    std::fs::remove_file(broken).ok();
}
