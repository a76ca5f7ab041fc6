//! The extraction path's outcomes with the real model: a record is `ok` only if it validates
//! against the schema as given (a lenient schema with a keyword the grammar cannot enforce
//! gets `schema_violation` with the validator's errors instead); a budget below the minimal
//! record is a typed refusal; verbatim strings are substrings of the document, escapes and
//! all; objects that do not mention `additionalProperties` are closed unless asked otherwise.

mod common;

use std::sync::Arc;

use quarry::engine::{EngineClient, EngineConfig, EngineCore};
use quarry::extract::{ExtractError, Extraction, Extractor, Outcome, Task};
use quarry_grammar::json::KeywordStatus;
use serde_json::{json, Value};

fn extractor() -> Option<(Arc<Extractor>, tokio::runtime::Runtime)> {
    let (backend, tok) = common::load(16384)?;
    let tok = Arc::new(tok);
    let engine = EngineCore::new(Box::new(backend), tok.clone(), EngineConfig::default());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    Some((Arc::new(Extractor::new(EngineClient::start(engine), tok)), runtime))
}

fn run(x: &Arc<Extractor>, rt: &tokio::runtime::Runtime, task: Task) -> Result<Extraction, ExtractError> {
    rt.block_on(x.run(task))
}

#[test]
fn a_record_that_fails_an_unenforced_keyword_is_a_schema_violation() {
    let Some((x, rt)) = extractor() else { return };
    // The grammar cannot enforce `not`; the only record it allows is {"n":0}, which `not`
    // forbids: every attempt ends in a violation, never in an `ok` that does not validate.
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 0}},
        "required": ["n"], "additionalProperties": false, "not": {"required": ["n"]}});
    let task = Task {
        retries: 2,
        ..Task::new(schema.clone(), "n is zero".into())
    };
    let out = run(&x, &rt, task).unwrap();
    assert_eq!(out.outcome, Outcome::SchemaViolation, "{}", out.text);
    assert!(out.data.is_none());
    assert_eq!(out.attempts, 3, "two retries, then the violation stands");
    assert_eq!(serde_json::from_str::<Value>(&out.text).unwrap(), json!({"n": 0}));
    let v = &out.violations[0];
    assert_eq!(
        (
            v.keyword.as_str(),
            v.instance_pointer.as_str(),
            v.schema_pointer.as_str()
        ),
        ("not", "", "/not")
    );

    // A lenient schema with `uniqueItems` (rejected by the grammar): whatever the model
    // writes, an `ok` record validates and a duplicate is reported as a violation.
    let tags = json!({"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
        "minItems": 4, "maxItems": 4, "uniqueItems": true}}, "required": ["tags"], "additionalProperties": false});
    let validator = jsonschema::validator_for(&tags).unwrap();
    let mut violations = 0;
    for (i, doc) in ["Tags: red, green.", "Colors: blue, blue, red, green", "red red red red"]
        .iter()
        .enumerate()
    {
        let out = run(
            &x,
            &rt,
            Task {
                temperature: 1.0,
                seed: Some(i as u64),
                ..Task::new(tags.clone(), doc.to_string())
            },
        )
        .unwrap();
        match out.outcome {
            Outcome::Ok => assert!(validator.is_valid(out.data.as_ref().unwrap())),
            Outcome::SchemaViolation => {
                violations += 1;
                assert!(
                    out.violations.iter().all(|v| v.keyword == "uniqueItems"),
                    "{:?}",
                    out.violations
                );
            }
            o => panic!("{o:?}: {}", out.text),
        }
    }
    // Four items of three colors always repeat one.
    assert_eq!(violations, 3);
    x.client.shutdown();
}

#[test]
fn a_budget_below_the_minimal_record_is_refused_and_one_at_it_closes() {
    let Some((x, rt)) = extractor() else { return };
    let schema = json!({"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
        "items": {"type": "string"}, "minItems": 2}}, "required": ["name", "tags"]});
    // {"name":"","tags":["",""]}
    let minimum = 26;
    let task = |max_tokens| Task {
        max_tokens,
        ..Task::new(
            schema.clone(),
            "Ada Lovelace, tagged math, poetry, engines and looms.".into(),
        )
    };
    let err = run(&x, &rt, task(minimum - 1)).err().expect("refused");
    assert_eq!(err.kind(), "max_tokens_too_small", "{err}");
    let out = run(&x, &rt, task(minimum)).unwrap();
    assert_eq!(out.outcome, Outcome::Ok, "{}", out.text);
    assert!(out.completion_tokens <= minimum);
    assert!(jsonschema::validator_for(&schema)
        .unwrap()
        .is_valid(out.data.as_ref().unwrap()));
    x.client.shutdown();
}

#[test]
fn verbatim_strings_are_substrings_of_the_document() {
    let Some((x, rt)) = extractor() else { return };
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string"}, "title": {"type": "string"}, "path": {"type": ["string", "null"]},
        "city": {"type": "string"}, "quote": {"type": "string"}
    }, "required": ["name", "title", "path", "city", "quote"], "additionalProperties": false});
    let documents = [
        "Employee: José \"Pepe\" Núñez\nTitle: Senior Engineer, Zürich office\nHome dir: C:\\Users\\jnunez\\new\nHe said: \"ship it\" — then left.",
        "名前: 山田太郎 (Yamada Taro)\n役職: 部長\n場所: 東京\nNote: back\\slash and \"quotes\"\ttab",
        "Ms. O'Brien, CFO of Smith & Sons, Dublin. Motto: \"Less is more\\n more or less\".",
    ];
    for document in documents {
        for temperature in [0.0, 1.0] {
            let out = run(
                &x,
                &rt,
                Task {
                    verbatim: true,
                    temperature,
                    seed: Some(5),
                    ..Task::new(schema.clone(), document.to_string())
                },
            )
            .unwrap();
            assert_eq!(out.outcome, Outcome::Ok, "{}", out.text);
            for (k, v) in out.data.as_ref().unwrap().as_object().unwrap() {
                if let Some(s) = v.as_str() {
                    assert!(document.contains(s), "{k}: {s:?} is not in {document:?}");
                }
            }
        }
    }
    x.client.shutdown();
}

#[test]
fn objects_that_say_nothing_of_additional_properties_are_closed_unless_asked() {
    let Some((x, rt)) = extractor() else { return };
    let schema = json!({"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
        "required": ["name"]});
    let doc = "Ada Lovelace lived in London with her cat and her notebooks.";
    let out = run(&x, &rt, Task::new(schema.clone(), doc.into())).unwrap();
    assert_eq!(out.outcome, Outcome::Ok, "{}", out.text);
    let keys: Vec<&String> = out.data.as_ref().unwrap().as_object().unwrap().keys().collect();
    assert!(keys.iter().all(|k| *k == "name" || *k == "city"), "{keys:?}");
    let narrowed = |x: &Extraction| {
        x.compiled
            .report()
            .unwrap()
            .keywords
            .iter()
            .any(|k| k.keyword == "additionalProperties" && matches!(k.status, KeywordStatus::Narrowed(_)))
    };
    assert!(narrowed(&out), "the report says the object was closed");
    let open = run(
        &x,
        &rt,
        Task {
            open_objects: true,
            ..Task::new(schema, doc.into())
        },
    )
    .unwrap();
    assert!(!narrowed(&open));
    assert_eq!(open.outcome, Outcome::Ok, "{}", open.text);
    x.client.shutdown();
}
