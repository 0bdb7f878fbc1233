//! Registrations: refused when they ask for more workers than the run gives a node, or
//! are bound to no lease.

use prost::Message;

use super::*;

#[test]
fn a_member_asking_for_more_workers_than_the_run_gives_a_node_is_refused() {
    let k = keys();
    let mut v = View {
        allowed: Allowed {
            workers_per_node: 1..=1,
            ..Allowed::default()
        },
        ..View::default()
    };
    let at = At {
        lease: 9,
        ..At::default()
    };
    let forged = member("forged", 5);
    put(&mut v, &k, &k.of(&forged), &forged.encode_to_vec(), at);
    let fine = member("fine", 1);
    put(&mut v, &k, &k.of(&fine), &fine.encode_to_vec(), at);
    assert_eq!(v.members.keys().collect::<Vec<_>>(), ["fine"]);
    assert!(v.refused[&k.of(&forged)].contains("local_world_size 5"));
    assert_eq!(v.corruption(), None);
}

#[test]
fn a_member_without_a_lease_is_refused_not_fatal() {
    let k = keys();
    let mut v = View::default();
    let ghost = member("ghost", 1);
    put(
        &mut v,
        &k,
        &k.of(&ghost),
        &ghost.encode_to_vec(),
        At::default(),
    );
    assert!(v.members.is_empty());
    assert_eq!(v.corruption(), None);
    assert!(v.refused[&k.of(&ghost)].contains("not bound to a lease"));
}
